"""``transformer_engine.pytorch.module``: the stand-in's Transformer Engine modules."""

from megatron_core.transformer_engine.pytorch.module.base import (
    TransformerEngineBaseModule,
    UserBufferQuantizationMode,
    destroy_ub,
    initialize_ub,
)
from megatron_core.transformer_engine.pytorch.module.grouped_linear import GroupedLinear
from megatron_core.transformer_engine.pytorch.module.layernorm import LayerNorm
from megatron_core.transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
from megatron_core.transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP
from megatron_core.transformer_engine.pytorch.module.linear import Linear
from megatron_core.transformer_engine.pytorch.module.rmsnorm import RMSNorm

__all__ = [
    # base.py
    "TransformerEngineBaseModule",
    "UserBufferQuantizationMode",
    "initialize_ub",
    "destroy_ub",
    # the modules
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
]
