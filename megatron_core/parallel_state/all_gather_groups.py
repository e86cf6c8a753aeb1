"""megatron-core 0.18's ``create_all_gather_groups``: second communicators for FSDP all-gathers.

A sharded data-parallel wrapper all-gathers parameters while it reduce-scatters gradients. On one
communicator the two queue behind each other; on two they can overlap. This builds, after
``initialize_model_parallel``, a new group over the ranks of every data x context group (and, if
asked, of every expert data-parallel group): the same ranks, a new communicator each (never one
of parallel_state's cached groups). The caller keeps them, e.g. in ``ProcessGroupCollection``'s
``dp_cp_ag`` / ``expt_dp_ag``.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from megatron_core import device
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.agreement import agree_on_arguments
from megatron_core.parallel_state.groups import (
    create_group,
    get_nccl_options,
    validate_nccl_comm_cfgs,
)
from megatron_core.parallel_state.layout import layout_of
from megatron_core.parallel_state.state import _state

__all__ = ["create_all_gather_groups"]


def create_all_gather_groups(for_expert_parallelism=False, timeout=None, nccl_comm_cfgs=None):
    """Create all-gather groups with the data-parallel ranks, on new communicators.

    Collective over WORLD: every rank calls it with the same arguments (checked first; a
    difference raises on every rank) and creates every group, keeping its own.

    Example: 4 ranks, tp=2 -> data x context groups [0, 2] and [1, 3]; rank 2 gets a new group
    over [0, 2] that is not ``get_data_parallel_group(with_context_parallel=True)``.

    Args:
        for_expert_parallelism: also create the expert data-parallel all-gather groups (only
            when expert_model_parallel_size > 1, as in megatron-core).
        timeout: a ``datetime.timedelta`` for the new groups (None: torch's default).
        nccl_comm_cfgs: ``{group name: {key: value}}``; the "dp_cp" / "ep_dp" entries apply to
            NCCL groups (validated on every backend, see NOTE [ NCCL-only options ]).

    Returns:
        ``(dp_cp_ag_group, expt_dp_ag_group)``; the second is None unless requested and ep > 1.

    Raises:
        MegatronCoreError: parallel_state is not initialized (also a RuntimeError, which
            megatron-core raises), a bad ``timeout`` or config.
    """
    state = _state()
    error = None
    try:
        if not state.initialized:
            raise MegatronCoreError(
                "create_all_gather_groups() needs parallel_state: call "
                "initialize_model_parallel() first"
            )
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise MegatronCoreError(f"timeout ({timeout!r}) must be a datetime.timedelta or None")
        cfgs = validate_nccl_comm_cfgs(nccl_comm_cfgs, "nccl_comm_cfgs")
    except MegatronCoreError as exc:
        error = exc
    outcome = "ok" if error is None else f"invalid: {error}"
    agree_on_arguments(
        "create_all_gather_groups",
        {"for_expert_parallelism": repr(bool(for_expert_parallelism)), "timeout": repr(timeout),
         "outcome": outcome},
    )  # fmt: skip
    if error is not None:
        raise error
    layout = layout_of(state.sizes)
    dp_cp_ag = _create(layout["dp-cp"], "dp_cp", cfgs, timeout, "DATA_PARALLEL_GROUP_WITH_CP_AG")
    expt_dp_ag = None
    if for_expert_parallelism and state.sizes.ep > 1:
        expt_dp_ag = _create(
            layout["expt-dp"], "ep_dp", cfgs, timeout, "EXPERT_DATA_PARALLEL_GROUP_AG"
        )
    return dp_cp_ag, expt_dp_ag


def _create(rank_lists, name, cfgs, timeout, desc):
    """Create a group for each rank list (every rank, in order); return this rank's."""
    nccl = device.backend_uses_cuda(dist.get_backend())
    pg_options = get_nccl_options(name, cfgs) if nccl else None
    mine = None
    for ranks in rank_lists:
        group = create_group(ranks, timeout=timeout, pg_options=pg_options, group_desc=desc)
        if dist.get_rank() in ranks:
            mine = group
    return mine
