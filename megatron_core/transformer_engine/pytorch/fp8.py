"""``transformer_engine.pytorch.fp8``: the older path of ``quantization`` (megatron-core imports
``FP8GlobalStateManager``, ``fp8_autocast`` and ``fp8_model_init`` from here)."""

from megatron_core.transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from megatron_core.transformer_engine.pytorch.quantization import (
    FP8GlobalStateManager,
    autocast,
    check_fp8_support,
    fp8_autocast,
    fp8_model_init,
    get_default_fp8_recipe,
    is_fp8_available,
    quantized_model_init,
)

__all__ = [
    "Recipe",
    "DelayedScaling",
    "Format",
    "MXFP8BlockScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
    "FP8GlobalStateManager",
    "autocast",
    "check_fp8_support",
    "fp8_autocast",
    "fp8_model_init",
    "get_default_fp8_recipe",
    "is_fp8_available",
    "quantized_model_init",
]
