"""Megatron-compatible getters and setters for tensor, data and context parallelism.

Re-exported by :mod:`megatron_core.parallel_state`. Each reads (or, for ``set_*``, writes) the one
ParallelState. Where megatron-core 0.16 asserts, these raise MegatronCoreError (an AssertionError
too); where it returns 0 because torch.distributed is not initialized, so do these. Values given to
``set_*`` win over the groups, before and after initialization. Ranks are global unless the name
says otherwise; ``*_rank`` without "global" is the index inside the group.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.state import _state

__all__ = [
    # groups
    "get_model_parallel_group",
    "get_tensor_model_parallel_group",
    "get_data_parallel_group",
    "has_separate_all_gather_group",
    "get_data_parallel_group_gloo",
    "get_context_parallel_group",
    "get_context_parallel_global_ranks",
    "get_hierarchical_context_parallel_groups",
    "get_hybrid_data_context_parallel_groups",
    "get_amax_reduction_group",
    "get_tensor_and_data_parallel_group",
    "get_tensor_and_context_parallel_group",
    # sizes and ranks
    "set_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_model_parallel_src_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "set_data_parallel_rank",
    "get_data_parallel_rank",
    "get_context_parallel_world_size",
    "get_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    # megatron-core 0.19 (generalized TP: groups of one rank, the remat size being 1)
    "get_gtp_weight_remat_group",
    "get_gtp_weight_remat_world_size",
    "get_gtp_weight_remat_rank",
    "get_gtp_weight_remat_global_ranks",
    # extensions (not in megatron-core 0.16)
    "get_tensor_model_parallel_global_ranks",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
]


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _size_or_zero(kind: str) -> int:
    """Size of this rank's group of ``kind``; 0 without torch.distributed or the group."""
    group = _state().group(kind, check=False) if _dist_ready() else None
    return 0 if group is None else group.size()


def _rank_or_zero(kind: str) -> int:
    """This rank's index in its group of ``kind``; 0 without torch.distributed or the group."""
    group = _state().group(kind, check=False) if _dist_ready() else None
    return 0 if group is None else group.rank()


def _global_ranks_or_none(kind: str, check_initialized: bool) -> list[int] | None:
    """Global ranks of this rank's group of ``kind``; None if there is none and
    ``check_initialized`` is False."""
    state = _state()
    if state.group(kind, check_initialized) is None:
        return None
    return state.ranks[kind]


def _dp_kind(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if not with_context_parallel:
        if partial_data_parallel:
            raise MegatronCoreError(
                "partial_data_parallel=True needs with_context_parallel=True: the partial "
                "data-parallel groups of the distributed optimizer include context parallelism"
            )
        return "dp"
    return "intra-dp-cp" if partial_data_parallel else "dp-cp"


# --- groups ----------------------------------------------------------------------------------


def get_model_parallel_group(check_initialized=True):
    """The model-parallel group: the tensor x pipeline ranks that hold one full model copy.

    Args:
        check_initialized: True (default): raise MegatronCoreError if there is no such group;
            False: return None then. The same flag on every ``get_*_group`` below.
    """
    return _state().group("mp", check_initialized)


def get_tensor_model_parallel_group(check_initialized=True):
    """The tensor-parallel group of this rank (ranks that split one layer's weights)."""
    return _state().group("tp", check_initialized)


def get_data_parallel_group(
    with_context_parallel=False,
    partial_data_parallel=False,
    independent_all_gather=False,
    *,
    with_gtp_remat=True,
):
    """The data-parallel group (replicas of the same model shard).

    Args:
        with_context_parallel: the data x context group instead (gradients are reduced there).
        partial_data_parallel: with context parallel only: this rank's distributed-optimizer
            instance's part of it (the whole group with one instance).
        independent_all_gather: with context parallel only: the separate all-gather group over
            the same ranks (initialize_model_parallel(create_all_gather_group=True)).
        with_gtp_remat: (megatron-core 0.19) include the generalized-TP remat ranks; the same
            group here, where the remat size is 1.
    """
    kind = _dp_kind(with_context_parallel, partial_data_parallel)
    if kind == "dp-cp" and independent_all_gather:
        kind = "dp-cp-ag"
    return _state().group(kind)


def has_separate_all_gather_group() -> bool:
    """True if initialize_model_parallel created the separate data x context all-gather group."""
    return "dp-cp-ag" in _state().groups


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """A gloo group over the same ranks as get_data_parallel_group (for CPU-side collectives)."""
    state = _state()
    kind = _dp_kind(with_context_parallel, partial_data_parallel)
    if kind not in state.gloo_groups:
        if state.initialized:
            raise MegatronCoreError(
                f"{kind} gloo group was not created: initialize_model_parallel was called with "
                f"create_gloo_process_groups=False"
            )
        state.group(kind)  # raises "not initialized"
    return state.gloo_groups[kind]


def get_context_parallel_group(check_initialized=True):
    """The context-parallel group (ranks that split one sequence)."""
    return _state().group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized=True):
    """Global ranks of this rank's context-parallel group (None if unchecked and uninitialized)."""
    state = _state()
    return state.member_ranks("cp") if state.group("cp", check_initialized) else None


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's context-parallel sub-group at each level of hierarchical_context_parallel_sizes.

    Returns:
        A list of ProcessGroups, innermost level first (None if unchecked and not created).
    """
    groups = _state().hierarchical_cp_groups
    if groups is None and check_initialized:
        raise MegatronCoreError(
            "hierarchical context parallel groups are not initialized: pass "
            "hierarchical_context_parallel_sizes to initialize_model_parallel"
        )
    return groups


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """This rank's hybrid data x context group of ``group_size`` ranks.

    The whole data x context group when ``group_size`` equals its size; otherwise one of the
    groups initialize_model_parallel(hybrid_context_parallel=True) made (sizes 2, 4, ...).
    """
    state = _state()
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return state.group("dp-cp", check_initialized)
    group = state.hybrid_dp_cp_groups.get(group_size)
    if group is None and check_initialized:
        raise MegatronCoreError(
            f"no hybrid data x context parallel group of size {group_size!r}; sizes created: "
            f"{sorted(state.hybrid_dp_cp_groups)} (initialize_model_parallel("
            f"hybrid_context_parallel=True) creates them)"
        )
    return group


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The FP8 amax reduction group: tensor x data (x context) ranks, or tensor (x context) only."""
    if tp_only_amax_red:
        return _state().group("tp-cp" if with_context_parallel else "tp")
    return _state().group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    """The tensor x data (x context, if asked) parallel group."""
    return _state().group("tp-dp-cp" if with_context_parallel else "tp-dp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized=True):
    """The tensor x context parallel group."""
    return _state().group("tp-cp", check_initialized)


# --- sizes and ranks -------------------------------------------------------------------------


def set_tensor_model_parallel_world_size(world_size):
    """Override the tensor-parallel size get_tensor_model_parallel_world_size returns."""
    _state().overrides["tp_size"] = world_size


def get_tensor_model_parallel_world_size():
    """Tensor-parallel size tp (or the value set by set_tensor_model_parallel_world_size)."""
    override = _state().overrides.get("tp_size")
    return override if override is not None else _state().size_of("tp")


def set_tensor_model_parallel_rank(rank):
    """Override the rank get_tensor_model_parallel_rank returns."""
    _state().overrides["tp_rank"] = rank


def get_tensor_model_parallel_rank():
    """This rank's index in its tensor-parallel group, in [0, tp) (or the value set)."""
    override = _state().overrides.get("tp_rank")
    return override if override is not None else _state().rank_in("tp")


def get_tensor_model_parallel_src_rank():
    """Global rank of tensor-parallel rank 0 in this rank's group (the broadcast source)."""
    return _state().member_ranks("tp")[0]


def get_model_parallel_src_rank():
    """Global rank of the first rank of this rank's model-parallel (tensor x pipeline) group."""
    return _state().member_ranks("mp")[0]


def get_data_parallel_src_rank(with_context_parallel=False):
    """Global rank of data-parallel rank 0 in this rank's data(-x-context)-parallel group."""
    return _state().member_ranks("dp-cp" if with_context_parallel else "dp")[0]


def get_data_parallel_world_size(
    with_context_parallel=False, partial_data_parallel=False, *, with_gtp_remat=True
):
    """Data-parallel size dp (dp * cp with context folded in); 0 without torch.distributed.
    ``with_gtp_remat`` (0.19) changes nothing at remat size 1."""
    override = _state().overrides.get("dp_size")
    if override is not None:
        return override
    if not _dist_ready():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).size()


def set_data_parallel_rank(rank):
    """Override the rank get_data_parallel_rank returns."""
    _state().overrides["dp_rank"] = rank


def get_data_parallel_rank(
    with_context_parallel=False, partial_data_parallel=False, *, with_gtp_remat=True
):
    """This rank's index in its data-parallel group; 0 without torch.distributed.
    ``with_gtp_remat`` (0.19) changes nothing at remat size 1."""
    override = _state().overrides.get("dp_rank")
    if override is not None:
        return override
    if not _dist_ready():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).rank()


def get_context_parallel_world_size():
    """Context-parallel size cp; 0 without torch.distributed."""
    return _state().size_of("cp") if _dist_ready() else 0


def get_context_parallel_rank():
    """This rank's index in its context-parallel group; 0 without torch.distributed."""
    return _state().rank_in("cp") if _dist_ready() else 0


def get_tensor_and_context_parallel_world_size():
    """tp * cp; 0 without torch.distributed."""
    return _state().size_of("tp-cp") if _dist_ready() else 0


def get_tensor_and_context_parallel_rank():
    """This rank's index in its tensor x context group; 0 without torch.distributed."""
    return _state().rank_in("tp-cp") if _dist_ready() else 0


# --- extensions ------------------------------------------------------------------------------


def get_tensor_model_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's tensor-parallel group, in group order (not in 0.16)."""
    return list(_state().member_ranks("tp"))


def get_model_parallel_rank() -> int:
    """This rank's index in its model-parallel (tp x pp) group (not in 0.16)."""
    return _state().rank_in("mp")


def get_model_parallel_world_size() -> int:
    """tp * pp (not in 0.16)."""
    return _state().size_of("mp")


# --- megatron-core 0.19: generalized-TP weight-remat group (size 1 here) -------------------------


def get_gtp_weight_remat_group(check_initialized=True):
    """This rank's generalized-TP weight-remat group (megatron-core 0.19): just this rank, as
    remat sizes above 1 are not implemented (model_parallel_config.check_gtp_size)."""
    return _state().group("gtp-remat", check_initialized)


def get_gtp_weight_remat_world_size():
    """Size of the weight-remat group (1); 0 without torch.distributed or the group."""
    return _size_or_zero("gtp-remat")


def get_gtp_weight_remat_rank():
    """This rank's index in its weight-remat group (0)."""
    return _rank_or_zero("gtp-remat")


def get_gtp_weight_remat_global_ranks(check_initialized=True):
    """Global ranks of this rank's weight-remat group (``[global_rank]``); None if there is none
    and ``check_initialized`` is False."""
    return _global_ranks_or_none("gtp-remat", check_initialized)
