"""``transformer_engine.pytorch.RMSNorm`` (module ``pytorch.module.rmsnorm``)."""

from __future__ import annotations

from megatron_core.transformer_engine.pytorch.module.layernorm import _Norm

__all__ = ["RMSNorm"]


class RMSNorm(_Norm):
    """Root-mean-square normalization with a learned scale (``weight``, no bias).

    y = x / sqrt(mean(x^2) + eps) * gamma, gamma = weight (1 + weight with
    ``zero_centered_gamma``). Arguments as
    :class:`~megatron_core.transformer_engine.pytorch.LayerNorm`'s.
    """

    _NORMALIZATION = "RMSNorm"
    _HAS_BIAS = False
