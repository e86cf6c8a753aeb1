"""``transformer_engine.pytorch.utils``: the helpers megatron-core imports from it."""

from __future__ import annotations

from typing import Any

from megatron_core.transformer_engine._refuse import not_provided

__all__ = [
    "make_weak_ref",
    "get_device_compute_capability",
    "get_cudnn_version",
    "is_bf16_available",
]


def make_weak_ref(*args: Any, **kwargs: Any):
    """Refused: weak references to CUDA graph buffers (CUDA graphs of Transformer Engine
    modules)."""
    raise not_provided("make_weak_ref (CUDA graph buffers of Transformer Engine modules)")


def get_device_compute_capability() -> tuple[int, int]:
    """(0, 0): the stand-in needs no particular GPU."""
    return (0, 0)


def get_cudnn_version() -> tuple[int, int, int]:
    """(0, 0, 0): cuDNN is not used."""
    return (0, 0, 0)


def is_bf16_available(return_reason: bool = False):
    """True: bf16 runs wherever torch runs it."""
    return (True, "") if return_reason else True
