"""``transformer_engine.pytorch.ops``: Transformer Engine's operation fuser, refused by name.

megatron-core builds fused MLPs and norms from these operations (``TEFusedMLP`` with
``use_te_op_fuser``, ``TEActivationOp`` with ``use_te_activation_func``,
``TEFusedResidualRMSNorm`` with ``fused_residual_rmsnorm``). The names exist so that
megatron-core's classes can be defined; making any of them raises, naming the operation. The
grouped-MLP operations (``GroupedLinear``, ``ScaledSwiGLU``, ...) are absent, so megatron-core
finds the fused expert path unavailable and takes its own.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.transformer_engine._refuse import not_provided

_INSTEAD = (
    "Leave use_te_op_fuser, use_te_activation_func and fused_residual_rmsnorm off: the "
    "Transformer Engine spec's unfused layers run"
)


class FusibleOperation(torch.nn.Module):
    """An operation of Transformer Engine's fuser: making one is refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise not_provided(
            f"transformer_engine.pytorch.ops.{type(self).__name__} (the operation fuser)",
            _INSTEAD,
        )


def _operation(name: str) -> type:
    return type(name, (FusibleOperation,), {"__doc__": f"Refused: the fuser's {name} operation."})


AllGather = _operation("AllGather")
AllReduce = _operation("AllReduce")
BasicLinear = _operation("BasicLinear")
BasicOperation = _operation("BasicOperation")
Bias = _operation("Bias")
GEGLU = _operation("GEGLU")
GELU = _operation("GELU")
LayerNorm = _operation("LayerNorm")
Linear = _operation("Linear")
MakeExtraOutput = _operation("MakeExtraOutput")
ReGLU = _operation("ReGLU")
ReLU = _operation("ReLU")
RMSNorm = _operation("RMSNorm")
ReduceScatter = _operation("ReduceScatter")
Sequential = _operation("Sequential")
SiLU = _operation("SiLU")
SwiGLU = _operation("SwiGLU")

__all__ = [
    "FusibleOperation",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "BasicOperation",
    "Bias",
    "GEGLU",
    "GELU",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "ReGLU",
    "ReLU",
    "RMSNorm",
    "ReduceScatter",
    "Sequential",
    "SiLU",
    "SwiGLU",
]
