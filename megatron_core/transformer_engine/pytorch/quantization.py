"""``transformer_engine.pytorch.quantization`` (and its older path ``fp8``): the quantization
contexts, which run the enclosed code unchanged while quantization is off and refuse it on.

Transformer Engine's ``autocast(enabled=True)`` and ``quantized_model_init(enabled=True)`` (the
older ``fp8_autocast`` / ``fp8_model_init``) switch FP8, MXFP8 or FP4 on; the stand-in has no
quantized kernels, so entering one of them enabled (or calibrating) raises, naming the recipe
(NOTE [ Transformer Engine stand-in ], rule 5). Entered disabled they do nothing, which is how
megatron-core uses them around high-precision layers. :class:`FP8GlobalStateManager` answers
"quantization is off" to every question megatron-core asks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron_core.transformer_engine._refuse import not_provided
from megatron_core.transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

__all__ = [
    "FP8GlobalStateManager",
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "quantized_model_init",
    "is_fp8_available",
    "is_mxfp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
    "check_fp8_support",
    "check_mxfp8_support",
    "check_nvfp4_support",
    "check_fp8_block_scaling_support",
    "get_default_recipe",
    "get_default_fp8_recipe",
]

_UNAVAILABLE = "the Transformer Engine stand-in has no quantized kernels (pure torch)"


def _kind(recipe: Recipe | None) -> str:
    """The quantization a recipe asks for, as the refusal names it."""
    if recipe is None:
        return "FP8 (the default DelayedScaling recipe)"
    if isinstance(recipe, NVFP4BlockScaling):
        return "FP4 (NVFP4BlockScaling recipe)"
    if isinstance(recipe, MXFP8BlockScaling):
        return "MXFP8 (MXFP8BlockScaling recipe)"
    if isinstance(recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
        return f"FP8 ({type(recipe).__name__} recipe)"
    return f"quantization ({type(recipe).__name__} recipe)"


def check_fp8_support() -> tuple[bool, str]:
    """(False, why): no FP8 here."""
    return False, _UNAVAILABLE


check_mxfp8_support = check_fp8_support
check_nvfp4_support = check_fp8_support
check_fp8_block_scaling_support = check_fp8_support


def _available(return_reason: bool) -> bool | tuple[bool, str]:
    return (False, _UNAVAILABLE) if return_reason else False


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """False (with the reason when ``return_reason``): the stand-in does not quantize."""
    return _available(return_reason)


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """False (with the reason when ``return_reason``)."""
    return _available(return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """False (with the reason when ``return_reason``)."""
    return _available(return_reason)


def is_nvfp4_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """False (with the reason when ``return_reason``)."""
    return _available(return_reason)


def get_default_fp8_recipe() -> Recipe:
    """The recipe Transformer Engine uses when none is given: ``DelayedScaling()``."""
    return DelayedScaling()


get_default_recipe = get_default_fp8_recipe


class FP8GlobalStateManager:
    """Transformer Engine's global quantization state, which here is always "off".

    Every predicate answers False, the recipe is the default one, the group None; the methods
    that update FP8 metadata have nothing to update.
    """

    @classmethod
    def reset(cls) -> None:
        """Nothing to reset."""

    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        """(False, why)."""
        return check_fp8_support()

    is_mxfp8_available = is_fp8_available
    is_fp8_block_scaling_available = is_fp8_available
    is_nvfp4_available = is_fp8_available

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """False: no quantized region is ever entered."""
        return False

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        """False."""
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """False: parameters are never quantized."""
        return False

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        """False."""
        return False

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """False."""
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """False."""
        return False

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The default recipe (no region sets another)."""
        return get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        """None: no amax reduction group."""
        return None

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        """None."""
        return None

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        """Nothing to skip: no FP8 weights."""

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta) -> None:
        """Nothing to add: no FP8 metadata."""

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Nothing to reduce: no amax history."""


def _refuse_enabled(name: str, enabled: bool, calibrating: bool, recipe: Recipe | None) -> None:
    if enabled or calibrating:
        asked = f"enabled={enabled!r}" if enabled else f"calibrating={calibrating!r}"
        raise not_provided(
            f"{name}({asked}) asks for {_kind(recipe)}",
            "Train in bf16/fp16/fp32 (leave fp8/fp4 unset); the region runs unchanged with "
            "enabled=False",
        )


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Recipe | None = None,
    amax_reduction_group=None,
    _graph: bool = False,
) -> Iterator[None]:
    """Run the block quantized (refused) or, with ``enabled=False``, unchanged.

    Raises:
        MegatronCoreError: ``enabled`` or ``calibrating`` is True (the message names the recipe).
    """
    _refuse_enabled("autocast", enabled, calibrating, recipe)
    yield


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group=None,
    _graph: bool = False,
) -> Iterator[None]:
    """The older name of :func:`autocast` (``fp8_recipe``, ``fp8_group``).

    Raises:
        MegatronCoreError: ``enabled`` or ``calibrating`` is True.
    """
    _refuse_enabled("fp8_autocast", enabled, calibrating, fp8_recipe)
    yield


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
) -> Iterator[None]:
    """Create quantized parameters in the block (refused) or, disabled, ordinary ones.

    Raises:
        MegatronCoreError: ``enabled`` is True (quantized parameters, ``--fp8-param-gather``).
    """
    _refuse_enabled("quantized_model_init", enabled, False, recipe)
    yield


@contextlib.contextmanager
def fp8_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
) -> Iterator[None]:
    """The older name of :func:`quantized_model_init`.

    Raises:
        MegatronCoreError: ``enabled`` is True.
    """
    _refuse_enabled("fp8_model_init", enabled, False, recipe)
    yield
