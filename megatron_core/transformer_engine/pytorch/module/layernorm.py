"""``transformer_engine.pytorch.LayerNorm`` (module ``pytorch.module.layernorm``) and the base of
both norms."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.transformer_engine.pytorch.module._common import normalize, resolve_device
from megatron_core.transformer_engine.pytorch.module.base import (
    _warn_fp8_state_kept,
    decode_extra_state,
)

__all__ = ["LayerNorm"]


class _Norm(torch.nn.Module):
    """What LayerNorm and RMSNorm share: the shape, the deprecated argument names, the
    ``sequence_parallel`` mark and ``_extra_state`` (an empty uint8 tensor, as Transformer
    Engine's norm operations write without quantization; NOTE [ Extra state of Transformer
    Engine modules ])."""

    _NORMALIZATION = ""
    _HAS_BIAS = True

    def __init__(
        self,
        normalized_shape: Iterable[int] | int | None = None,
        eps: float = 1e-5,
        sequence_parallel: bool | None = None,
        params_dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        hidden_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if normalized_shape is None:
            if hidden_size is None:
                raise MegatronCoreError(f"{owner}: give normalized_shape (or hidden_size)")
            warnings.warn(
                f"{owner}: `hidden_size` is the older name of `normalized_shape`",
                DeprecationWarning,
                stacklevel=3,
            )
            normalized_shape = hidden_size
        elif hidden_size is not None:
            raise MegatronCoreError(
                f"{owner}: normalized_shape ({normalized_shape}) and hidden_size "
                f"({hidden_size}) are both given"
            )
        if params_dtype is not None and kwargs.get("dtype") is not None:
            raise MegatronCoreError(f"{owner}: dtype and params_dtype are both given")
        dtype = kwargs.pop("dtype", None) or params_dtype or torch.get_default_dtype()
        where = resolve_device(kwargs.pop("device", None))
        kwargs.pop("sm_margin", None)  # CUDA kernels' SM reservation: nothing to reserve
        if kwargs:
            raise MegatronCoreError(f"{owner}: unknown arguments {sorted(kwargs)}")
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(int(n) for n in shape)
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(
            torch.empty(self.normalized_shape, device=where, dtype=dtype)
        )
        if self._HAS_BIAS:
            self.bias = torch.nn.Parameter(
                torch.empty(self.normalized_shape, device=where, dtype=dtype)
            )
        self._kept_extra_state = None
        if where.type != "meta":
            self.reset_parameters()

    def reset_parameters(self, defer_init: bool | None = None) -> None:
        """Scale 1 (0 with zero_centered_gamma), shift 0; mark ``sequence_parallel``."""
        if defer_init:
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self._HAS_BIAS:
                self.bias.zero_()
        if self.sequence_parallel is not None:
            for param in self.parameters(recurse=False):
                param.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The norm over the last ``len(normalized_shape)`` dimensions, in the activation dtype.

        Args:
            inp: [..., *normalized_shape].

        Returns:
            Same shape, in autocast's dtype inside autocast, else the input's.
        """
        if tuple(inp.shape[-len(self.normalized_shape) :]) != self.normalized_shape:
            raise MegatronCoreError(
                f"{type(self).__name__}: input shape {tuple(inp.shape)} does not end in "
                f"normalized_shape {self.normalized_shape}"
            )
        bias = self.bias if self._HAS_BIAS else None
        return normalize(
            inp,
            self.weight,
            bias,
            self._NORMALIZATION,
            self.eps,
            self.zero_centered_gamma,
            len(self.normalized_shape),
        )

    def get_extra_state(self) -> torch.Tensor:
        """NOTE [ Extra state of Transformer Engine modules ], rules 1 and 3."""
        if self._kept_extra_state is not None:
            return self._kept_extra_state
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """NOTE [ Extra state of Transformer Engine modules ], rules 2 and 3."""
        if decode_extra_state(state) is not None:
            _warn_fp8_state_kept(type(self).__name__)
            self._kept_extra_state = state

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}"
        )


class LayerNorm(_Norm):
    """Layer normalization with a learned scale (``weight``) and shift (``bias``).

    y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta, gamma = weight (1 + weight with
    ``zero_centered_gamma``). Transformer Engine's signature: ``normalized_shape`` (or the
    deprecated ``hidden_size``), ``eps``, ``sequence_parallel`` (only marks the parameters,
    megatron-core's use), ``params_dtype`` / ``dtype``, ``zero_centered_gamma``, ``device``
    ("meta" defers initialization), ``sm_margin`` (ignored).

    Raises:
        MegatronCoreError: no shape, both shape names, both dtype names or an unknown argument.
    """

    _NORMALIZATION = "LayerNorm"
