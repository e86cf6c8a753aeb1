"""NVTX ranges of ``megatron_core.utils`` (megatron-core's profiling hooks; re-exported there).

Off until ``configure_nvtx_profiling(True)``; the ranges open through ``megatron_core.device``
(CUDA's NVTX on cuda, nothing on cpu). Names are checked on pop either way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import wraps

from megatron_core import device

__all__ = ["configure_nvtx_profiling", "nvtx_range_push", "nvtx_range_pop", "nvtx_decorator"]

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
