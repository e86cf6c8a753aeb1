"""Arithmetic, version checks and rank-0 logging of ``megatron_core.utils`` (re-exported there)."""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.errors import MegatronCoreError

try:
    from packaging.version import Version as _Version
except ImportError:  # packaging is not a dependency; torch vendors it
    from torch._vendor.packaging.version import Version as _Version

__all__ = [
    "ensure_divisibility",
    "divide",
    "get_torch_version",
    "is_torch_min_version",
    "get_te_version",
    "is_te_min_version",
    "log_single_rank",
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
