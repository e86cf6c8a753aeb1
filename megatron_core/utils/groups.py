"""Process-group and wrapped-model helpers of ``megatron_core.utils`` (re-exported there)."""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from megatron_core import parallel_state

__all__ = [
    "get_tensor_model_parallel_group_if_none",
    "get_pg_size",
    "get_pg_rank",
    "get_pg_src_rank",
    "get_attr_wrapped_model",
    "get_model_type",
    "get_model_xattn",
    "get_model_config",
]


def get_tensor_model_parallel_group_if_none(
    tp_group, is_expert: bool = False, check_initialized: bool = True
):
    """``tp_group``, or parallel_state's (expert) tensor-parallel group when it is None.

    Follows megatron-core 0.16.1: without torch.distributed the answer is None; before
    ``initialize_model_parallel`` ``tp_group`` is passed through unchanged; a None group is
    replaced by the default one (rank 0 warns with a DeprecationWarning, as megatron-core does,
    because passing the group explicitly will become mandatory there).

    Args:
        tp_group: a process group (or any object with ``rank()`` and ``size()``), or None.
        is_expert: fall back to the expert-tensor-parallel group instead of the dense one.
        check_initialized: passed to the parallel_state getter (raise if the group is missing).

    Returns:
        The group to use, or None (no torch.distributed, or no group and no parallel state).
    """
    if not dist.is_initialized():
        return None
    if not parallel_state.is_initialized() or tp_group is not None:
        return tp_group
    if dist.get_rank() == 0:
        warnings.warn(
            "tp_group is None: using parallel_state's default tensor-parallel group "
            "(megatron-core will require passing tp_group)",
            DeprecationWarning,
            stacklevel=2,
        )
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def get_pg_size(group=None) -> int:
    """``group.size()``; 1 when torch.distributed is not initialized or ``group`` is None."""
    if not dist.is_initialized() or group is None:
        return 1
    return group.size()


def get_pg_rank(group=None) -> int:
    """``group.rank()``; 0 when torch.distributed is not initialized or ``group`` is None."""
    if not dist.is_initialized() or group is None:
        return 0
    return group.rank()


def get_pg_src_rank(group=None) -> int:
    """The global rank of ``group``'s local rank 0; 0 without torch.distributed or a group."""
    if not dist.is_initialized() or group is None:
        return 0
    return dist.get_process_group_ranks(group)[0]


def get_attr_wrapped_model(
    model, attr: str, allow_none: bool = True, return_model_obj: bool = False
) -> Any:
    """``attr`` of ``model`` or of the first module found by following ``.module`` wrappers.

    Args:
        model: a module, possibly wrapped (DDP, Float16Module, ...: each holds ``.module``).
        attr: attribute name.
        allow_none: accept an attribute whose value is None; otherwise keep unwrapping until
            the value is not None.
        return_model_obj: return the (unwrapped) object holding ``attr`` instead of its value.

    Raises:
        RuntimeError: ``model`` is a list, or no wrapper level has the attribute (megatron-core's
            exception type, which its callers catch).
    """
    if isinstance(model, list):
        raise RuntimeError(
            f"get_attr_wrapped_model({attr!r}) was given a list of {len(model)} models; pass one"
        )

    def missing(obj) -> bool:
        return not hasattr(obj, attr) if allow_none else getattr(obj, attr, None) is None

    level = model
    while missing(level):
        if not hasattr(level, "module"):
            raise RuntimeError(
                f"get_attr_wrapped_model: no attribute {attr!r}"
                f"{'' if allow_none else ' (not None)'} on {type(model).__name__} "
                f"or any module it wraps"
            )
        level = level.module
    return level if return_model_obj else getattr(level, attr)


def get_model_type(model):
    """The ``model_type`` attribute of ``model`` (unwrapping wrappers)."""
    return get_attr_wrapped_model(model, "model_type")


def get_model_xattn(model) -> bool:
    """The ``xattn_needed`` attribute of ``model`` (unwrapping), False when no level has one."""
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


def get_model_config(model):
    """The first non-None ``config`` attribute of ``model`` or a module it wraps."""
    return get_attr_wrapped_model(model, "config", allow_none=False)
