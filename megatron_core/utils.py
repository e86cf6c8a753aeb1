"""Shared helpers with megatron-core's names and semantics (``megatron.core.utils``).

megatron-core's tensor_parallel and pipeline_parallel import these from ``megatron.core.utils``;
its tests patch them there. The process-group and wrapped-model helpers live in
``_utils_groups.py``, the tensor helpers (viewless tensors, embedding wgrad, sharded tensors for
dist_checkpointing) in ``_utils_tensors.py``; both are re-exported here.

Deliberate differences from megatron-core 0.16.1: ``divide`` / ``ensure_divisibility`` raise
MegatronCoreError (an AssertionError, what megatron-core's ``assert`` raises) naming both values;
``is_te_min_version`` answers False when Transformer Engine is not installed (megatron-core
raises TypeError comparing None with a version); the NVTX helpers open ranges through
``megatron_core.device`` and do nothing on cpu.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from functools import wraps
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core._utils_groups import (
    get_attr_wrapped_model,
    get_model_config,
    get_model_type,
    get_model_xattn,
    get_pg_rank,
    get_pg_size,
    get_pg_src_rank,
    get_tensor_model_parallel_group_if_none,
)
from megatron_core._utils_tensors import (
    assert_viewless_tensor,
    drain_embedding_wgrad_compute,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
    make_viewless_tensor,
    prepare_input_tensors_for_wgrad_compute,
    safely_set_viewless_tensor_data,
)
from megatron_core.errors import MegatronCoreError

try:
    from packaging.version import Version as _Version
except ImportError:  # packaging is not a dependency; torch vendors it
    from torch._vendor.packaging.version import Version as _Version

__all__ = [
    # utils.py
    "GlobalMemoryBuffer",
    "ensure_divisibility",
    "divide",
    "get_torch_version",
    "is_torch_min_version",
    "get_te_version",
    "is_te_min_version",
    "log_single_rank",
    "configure_nvtx_profiling",
    "nvtx_range_push",
    "nvtx_range_pop",
    "nvtx_decorator",
    # _utils_groups.py
    "get_tensor_model_parallel_group_if_none",
    "get_pg_size",
    "get_pg_rank",
    "get_pg_src_rank",
    "get_attr_wrapped_model",
    "get_model_type",
    "get_model_xattn",
    "get_model_config",
    # _utils_tensors.py
    "make_viewless_tensor",
    "assert_viewless_tensor",
    "safely_set_viewless_tensor_data",
    "prepare_input_tensors_for_wgrad_compute",
    "drain_embedding_wgrad_compute",
    "make_tp_sharded_tensor_for_checkpoint",
    "make_sharded_tensor_for_checkpoint",
]


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise unless ``denominator`` is a positive integer that divides ``numerator``.

    Raises:
        MegatronCoreError: naming both values, e.g. ``10 is not divisible by 4``.
    """
    if not isinstance(denominator, int) or denominator < 1:
        raise MegatronCoreError(f"divisor ({denominator!r}) must be a positive integer")
    if not isinstance(numerator, int) or numerator % denominator:
        raise MegatronCoreError(f"{numerator!r} is not divisible by {denominator!r}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, after checking that the division is exact.

    Raises:
        MegatronCoreError: if ``denominator`` does not divide ``numerator``.
    """
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def get_torch_version():
    """The installed torch's version, as a ``packaging`` Version."""
    return _Version(torch.__version__)


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """True if torch is at least ``version`` (strictly newer when ``check_equality`` is False)."""
    if check_equality:
        return get_torch_version() >= _Version(version)
    return get_torch_version() > _Version(version)


def get_te_version():
    """Transformer Engine's version (a ``packaging`` Version), or None when it is not installed."""
    try:
        import transformer_engine as te
    except ImportError:
        return None
    text = getattr(te, "__version__", None)
    if text is None:
        try:
            text = version("transformer-engine")
        except PackageNotFoundError:
            return None
    return _Version(str(text))


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """True if Transformer Engine is installed and at least ``version`` (strictly newer when
    ``check_equality`` is False); False when it is not installed."""
    te_version = get_te_version()
    if te_version is None:
        return False
    if check_equality:
        return te_version >= _Version(version)
    return te_version > _Version(version)


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on global rank ``rank`` only.

    The rank is torch.distributed's when it is initialized, else the ``RANK`` environment
    variable (0 when unset or not a number).
    """
    if dist.is_initialized():
        this_rank = dist.get_rank()
    else:
        try:
            this_rank = int(os.environ.get("RANK", 0))
        except ValueError:
            this_rank = 0
    if this_rank == rank:
        logger.log(*args, **kwargs)


# NVTX ranges (megatron-core's profiling hooks); off until configure_nvtx_profiling(True).
_nvtx_enabled: bool = False
_nvtx_range_messages: list[str] = []  # messages of the open ranges, innermost last


def configure_nvtx_profiling(enabled: bool) -> None:
    """Turn the NVTX range helpers on or off (off by default: they then do nothing)."""
    global _nvtx_enabled
    _nvtx_enabled = enabled


def _nvtx_message(msg: str | None, suffix: str | None) -> str:
    """``msg`` (default: ``module.function`` of the push/pop caller) with ``.suffix``."""
    if msg is None:
        frame = inspect.currentframe().f_back.f_back  # _nvtx_message <- push/pop <- caller
        module = inspect.getmodule(frame)
        msg = f"{module.__name__ if module else '?'}.{frame.f_code.co_name}"
    return msg if suffix is None else f"{msg}.{suffix}"


def nvtx_range_push(msg: str | None = None, suffix: str | None = None) -> None:
    """Open an NVTX range (if enabled), named ``msg`` or after the calling function.

    Args:
        msg: the range's name; default ``<module>.<calling function>``.
        suffix: appended as ``<msg>.<suffix>``.
    """
    if not _nvtx_enabled:
        return
    msg = _nvtx_message(msg, suffix)
    _nvtx_range_messages.append(msg)
    device.nvtx_range_push(msg)


def nvtx_range_pop(msg: str | None = None, suffix: str | None = None) -> None:
    """Close the innermost NVTX range (if enabled); its name must match ``msg`` (as for push).

    Raises:
        RuntimeError: no range is open.
        ValueError: the innermost open range has another name.
    """
    if not _nvtx_enabled:
        return
    msg = _nvtx_message(msg, suffix)
    if not _nvtx_range_messages:
        raise RuntimeError(f"nvtx_range_pop({msg!r}): no NVTX range is open")
    last = _nvtx_range_messages.pop()
    if msg != last:
        raise ValueError(f"nvtx_range_pop({msg!r}): the innermost open NVTX range is {last!r}")
    device.nvtx_range_pop()


def nvtx_decorator(message: str | None = None, color: str | None = None) -> Callable:
    """Decorator: run the function inside an NVTX range when profiling is enabled.

    As in megatron-core, the decision is taken when the function is decorated: with profiling
    off the function is returned unchanged.

    Args:
        message: the range's name; default ``<module>.<function name>``.
        color: accepted for megatron-core compatibility (torch's NVTX ranges have no color).
    """

    def decorator(func: Callable) -> Callable:
        if not _nvtx_enabled:
            return func
        name = message or f"{func.__module__}.{func.__name__}"

        @wraps(func)
        def wrapped(*args, **kwargs):
            device.nvtx_range_push(name)
            try:
                return func(*args, **kwargs)
            finally:
                device.nvtx_range_pop()

        return wrapped

    return decorator


class GlobalMemoryBuffer:
    """Reusable scratch tensors, one flat buffer per ``(name, dtype)``, to avoid re-allocation.

    ``get_tensor(shape, dtype, name)`` returns a view of shape ``shape`` over the first
    ``prod(shape)`` elements of the buffer for ``(name, dtype)``, growing it (a fresh, uninitialized
    allocation on the current device) when it is too small. Two calls with the same name and dtype
    return views of the same memory, so a caller must be done with one before asking again.

    Attributes:
        buffer: ``(name, dtype)`` -> the flat tensor behind the views.
    """

    def __init__(self):
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape,
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable | None = None,
    ) -> torch.Tensor:
        """A ``tensor_shape`` view of the ``(name, dtype)`` buffer (contents are not cleared).

        Args:
            tensor_shape: the shape wanted.
            dtype: element type; each dtype has its own buffer.
            name: buffer name (megatron-core uses "mpu" for sequence-parallel all-gathers).
            mem_alloc_context: context manager entered around a (re)allocation, if given.
        """
        numel = math.prod(tensor_shape)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < numel:
            with (mem_alloc_context or nullcontext)():
                current = torch.empty(
                    numel, dtype=dtype, device=device.current_device(), requires_grad=False
                )
            self.buffer[(name, dtype)] = current
        return current[:numel].view(*tensor_shape)
