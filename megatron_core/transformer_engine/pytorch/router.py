"""``transformer_engine.pytorch.router``: the fused MoE router kernels, refused by name.

megatron-core imports these three names unconditionally from Transformer Engine 2.7 on and
calls them only with ``moe_router_fusion=True``; megatron-core's own router computes the same
without the fusion.
"""

from __future__ import annotations

from typing import Any

from megatron_core.transformer_engine._refuse import not_provided

__all__ = [
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
]

_INSTEAD = "Set moe_router_fusion=False (--moe-router-fusion off): megatron-core's router runs"


def fused_topk_with_score_function(*args: Any, **kwargs: Any):
    """Refused: the fused top-k routing kernel (``moe_router_fusion=True``)."""
    raise not_provided("fused_topk_with_score_function (moe_router_fusion=True)", _INSTEAD)


def fused_compute_score_for_moe_aux_loss(*args: Any, **kwargs: Any):
    """Refused: the fused auxiliary-loss score kernel (``moe_router_fusion=True``)."""
    raise not_provided("fused_compute_score_for_moe_aux_loss (moe_router_fusion=True)", _INSTEAD)


def fused_moe_aux_loss(*args: Any, **kwargs: Any):
    """Refused: the fused auxiliary-loss kernel (``moe_router_fusion=True``)."""
    raise not_provided("fused_moe_aux_loss (moe_router_fusion=True)", _INSTEAD)
