"""``transformer_engine.pytorch.module.base``: the base of the stand-in's modules.

# NOTE [ Extra state of Transformer Engine modules ]
Transformer Engine keeps a module's FP8 metadata in its ``_extra_state``; megatron-core writes it
into every checkpoint (a ``ShardedObject`` per module) and its ``TEGroupedLinear`` splits and
merges it per expert. The stand-in reads and writes Transformer Engine 2.x's format:
1. Written: with no FP8 metadata (always, here, unless rule 3 kept some), ``get_extra_state``
   returns ``torch.empty(0, dtype=torch.uint8)``, exactly what Transformer Engine >= 2.0 writes
   for a module that never ran under FP8. So a checkpoint of a stand-in model and one of a
   bf16 GPU run with real Transformer Engine hold the same extra states.
2. Read, nothing to keep: ``None`` (older checkpoints) and an empty tensor.
3. Read, FP8 metadata: a uint8 tensor holding a pickled dict (``recipe``,
   ``extra_fp8_variables``, the scale and amax-history tensors of delayed scaling; Transformer
   Engine >= 2.0), or an ``io.BytesIO`` of ``torch.save`` (Transformer Engine 1.x). It is
   decoded as Transformer Engine decodes it (the recipe types of ``common.recipe`` unpickle
   under their Transformer Engine names), its recipe and variables go into ``fp8_meta``
   (``fp8_checkpoint`` becomes True, so megatron-core's per-expert split works), and the
   module writes the same bytes back on its next save. The scales are not used: the stand-in
   runs in high precision. A warning says so once per process.
4. A checkpoint that lacks ``core_attention._extra_state`` still loads into
   ``DotProductAttention`` (megatron-core's sharded state dict leaves it out), as in
   Transformer Engine.
"""

from __future__ import annotations

import contextlib
import enum
import io
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.tensor_parallel.layer_params import init_from_fp32_draw
from megatron_core.transformer_engine._refuse import not_provided
from megatron_core.transformer_engine.pytorch.module._common import (
    activation_dtype,
    dummy_wgrad_for,
    resolve_device,
)

__all__ = [
    "TransformerEngineBaseModule",
    "get_dummy_wgrad",
    "get_default_init_method",
    "init_method_constant",
    "initialize_ub",
    "destroy_ub",
    "get_ub",
    "UserBufferQuantizationMode",
]


def get_default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """Transformer Engine's default weight initialization: normal, mean 0, std 0.023."""
    return init_method_normal(0.023)


def init_method_normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer drawing from N(0, std^2)."""

    def init(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init


def init_method_constant(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling with ``value``."""

    def init(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.constant_(tensor, value)

    return init


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """A cached tensor of ``shape`` and ``dtype`` on the current device (zeros if ``zero``),
    returned as the weight gradient where it went into ``main_grad``."""
    return dummy_wgrad_for(tuple(shape), dtype, resolve_device(None), zero)


class UserBufferQuantizationMode(enum.Enum):
    """The userbuffers' data formats (named only: userbuffers are refused)."""

    NONE = "none"
    FP8 = "fp8"


def initialize_ub(*args: Any, **kwargs: Any) -> None:
    """Refused: userbuffers (``--tp-comm-overlap``) need Transformer Engine on CUDA GPUs."""
    raise not_provided(
        "initialize_ub (userbuffers for tensor-parallel communication overlap, --tp-comm-overlap)",
        "Leave tp_comm_overlap off",
    )


def get_ub(name: str, use_fp8: bool = False):
    """Refused, as :func:`initialize_ub`."""
    raise not_provided(f"get_ub({name!r}) (userbuffers)")


def destroy_ub() -> None:
    """Nothing to destroy: no userbuffers are ever made."""


@dataclass
class _ParameterInitMeta:
    """How :meth:`TransformerEngineBaseModule.reset_parameters` initializes a parameter."""

    init_fn: Callable | None = None
    get_rng_state_tracker: Callable | None = None
    fp8_meta_index: int | None = None


_WARNED_FP8_STATE = False


class TransformerEngineBaseModule(torch.nn.Module):
    """What the stand-in's Transformer Engine modules share: the parallel group, parameter
    initialization (deferred on the meta device), the activation dtype and ``_extra_state``
    (NOTE [ Extra state of Transformer Engine modules ]).

    The FP8 attributes megatron-core reads (``fp8``, ``fp8_calibration``, ``fp8_meta``,
    ``primary_weights_in_fp8``) are there and say "no FP8".
    """

    def __init__(self) -> None:
        super().__init__()
        self.name = None
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_parameters = False
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "fp8_group": None}
        self.tp_group = None
        self.tp_size = 1
        self.tp_group_initialized = False
        self.sequence_parallel = False
        self.param_init_meta: dict[str, _ParameterInitMeta] = {}
        self.primary_weights_in_fp8 = False
        self.preserve_high_precision_init_val = False
        self.fsdp_wrapped = False
        self.fsdp_group = None
        self.activation_dtype: torch.dtype | None = None
        self.wgrad_accumulation_and_reduce_hooks: list[Callable] = []
        self.wgrad_store = None
        self.rng_tracker_name: str | None = None
        self._kept_extra_state: Any = None

    def register_parameter(self, name: str, param, **kwargs: Any) -> None:
        """``nn.Module.register_parameter`` that also records how to initialize ``param``
        (``init_fn``, ``get_rng_state_tracker``, ``fp8_meta_index``) the first time."""
        super().register_parameter(name, param)
        init_meta = self.__dict__.get("param_init_meta")
        if init_meta is not None and name not in init_meta:
            init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Initialize this module's own parameters with their ``init_fn``.

        A parameter on the meta device is first made on the current device. An ``init_fn``
        registered with ``get_rng_state_tracker`` draws inside that tracker's stream
        (``rng_tracker_name``, else the model-parallel one), as Transformer Engine does; a
        half-precision parameter gets the fp32 draw rounded (``init_from_fp32_draw``).

        Args:
            defer_init: do nothing (parameters stay as they are, e.g. on the meta device).
        """
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            meta = self.param_init_meta.get(name, _ParameterInitMeta())
            if param.device.type == "meta":
                where = resolve_device(None)
                param = torch.nn.Parameter(
                    torch.empty_like(param, device=where), param.requires_grad
                )
                setattr(self, name, param)
            if meta.init_fn is None:
                continue
            fork = contextlib.nullcontext()
            if meta.get_rng_state_tracker is not None:
                tracker = meta.get_rng_state_tracker()
                name_ = self.rng_tracker_name
                fork = tracker.fork(name_) if name_ else tracker.fork()
            with fork, torch.no_grad():
                init_from_fp32_draw(meta.init_fn, param)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Use ``tp_group`` for the module's tensor-parallel communication."""
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Transformer Engine sets up FP8 metadata here; without FP8 it only records that
        there is none (``fp8``, ``fp8_calibration`` False) and the GEMM count."""
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta["num_gemms"] = num_gemms

    def get_extra_state(self) -> torch.Tensor:
        """NOTE [ Extra state of Transformer Engine modules ], rules 1 and 3."""
        if self._kept_extra_state is not None:
            return self._kept_extra_state
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """NOTE [ Extra state of Transformer Engine modules ], rules 2 and 3."""
        decoded = decode_extra_state(state)
        if decoded is None:
            return
        _warn_fp8_state_kept(type(self).__name__)
        if isinstance(decoded.get("extra_fp8_variables"), dict):
            self.fp8_meta.update(decoded["extra_fp8_variables"])
        if "recipe" in decoded:
            self.fp8_meta["recipe"] = decoded["recipe"]
        self.fp8_meta["fp8_checkpoint"] = True
        self._kept_extra_state = state

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable) -> None:
        """Keep ``hook`` for :meth:`backward_dw` (which has nothing to compute here)."""
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        """False: weight gradients are never delayed (``delay_wgrad_compute`` is refused)."""
        return False

    def backward_dw(self) -> None:
        """Nothing to do: weight gradients are computed in backward."""

    def prepare_activation_dtype(self, inp: torch.Tensor) -> torch.dtype:
        """Record and return the activation dtype for ``inp`` (autocast's, else its own)."""
        self.activation_dtype = activation_dtype(inp)
        return self.activation_dtype


def decode_extra_state(state: Any) -> dict | None:
    """The FP8-metadata dict of a Transformer Engine ``_extra_state``, or None when it holds
    none (NOTE [ Extra state of Transformer Engine modules ], rules 2-3)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        if state.numel() == 0:
            return None
        decoded = pickle.loads(state.detach().cpu().numpy().tobytes())
    elif isinstance(state, io.BytesIO):
        state.seek(0)
        decoded = torch.load(state, map_location="cpu", weights_only=False)
    else:
        raise not_provided(
            f"an _extra_state of type {type(state).__name__}",
            "Transformer Engine writes a uint8 tensor (>= 2.0) or an io.BytesIO (1.x)",
        )
    return decoded if isinstance(decoded, dict) and decoded else None


def _warn_fp8_state_kept(owner: str) -> None:
    global _WARNED_FP8_STATE
    if not _WARNED_FP8_STATE:
        _WARNED_FP8_STATE = True
        warnings.warn(
            f"{owner}: the checkpoint holds Transformer Engine FP8 metadata; the stand-in keeps "
            "it (and saves it back) but runs in high precision and does not use it",
            UserWarning,
            stacklevel=3,
        )
