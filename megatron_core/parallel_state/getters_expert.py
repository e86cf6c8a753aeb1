"""Megatron-compatible getters and setters for expert parallelism and distributed-optimizer groups.

Re-exported by :mod:`megatron_core.parallel_state`; conventions as in getters_dense.py. Expert
groups come from the expert grid (NOTE [ Rank layout ], rule 4): expert tensor parallel (etp),
expert model parallel (ep), expert data parallel (world / (etp * ep * pp), context folded in).
"""

from __future__ import annotations

import warnings

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.getters_dense import (
    _dist_ready,
    _global_ranks_or_none,
    _rank_or_zero,
    _size_or_zero,
    get_context_parallel_rank,
    get_data_parallel_rank,
    get_tensor_model_parallel_rank,
)
from megatron_core.parallel_state.getters_pipeline import get_pipeline_model_parallel_rank
from megatron_core.parallel_state.state import _state

__all__ = [
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_src_rank",
    "get_expert_model_parallel_world_size",
    "set_expert_model_parallel_world_size",
    "get_expert_model_parallel_rank",
    "set_expert_model_parallel_rank",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_world_size",
    "set_expert_tensor_parallel_world_size",
    "get_expert_tensor_parallel_rank",
    "set_expert_tensor_parallel_rank",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_data_parallel_group",
    "get_data_modulo_expert_parallel_group",
    "get_expert_data_parallel_group_gloo",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_intra_distributed_optimizer_instance_group",
    "get_inter_distributed_optimizer_instance_group",
    "get_all_ranks",
    # megatron-core 0.19 (expert generalized TP: groups of one rank, the remat size being 1)
    "get_expert_gtp_weight_remat_group",
    "get_expert_gtp_weight_remat_world_size",
    "get_expert_gtp_weight_remat_rank",
    "get_expert_gtp_weight_remat_global_ranks",
    # extensions (older megatron-core names, not in 0.16)
    "get_tensor_and_expert_parallel_group",
    "get_tensor_and_expert_parallel_world_size",
    "get_data_modulo_expert_parallel_rank",
    "get_data_modulo_expert_parallel_world_size",
]


def _expert_dp_kind(partial_expert_data_parallel: bool) -> str:
    return "intra-expt-dp" if partial_expert_data_parallel else "expt-dp"


def get_expert_model_parallel_group(check_initialized=True):
    """The expert-parallel group: ranks that hold different experts of one MoE layer."""
    return _state().group("ep", check_initialized)


def get_expert_model_parallel_src_rank():
    """Global rank of the first rank of this rank's expert-parallel group."""
    return _state().member_ranks("ep")[0]


def get_expert_model_parallel_world_size():
    """Expert-parallel size ep (or the value set); 0 without torch.distributed."""
    override = _state().overrides.get("ep_size")
    if override is not None:
        return override
    return _state().size_of("ep") if _dist_ready() else 0


def set_expert_model_parallel_world_size(world_size):
    """Override the size get_expert_model_parallel_world_size returns."""
    _state().overrides["ep_size"] = world_size


def get_expert_model_parallel_rank():
    """This rank's index in its expert-parallel group (or the value set); 0 without dist."""
    override = _state().overrides.get("ep_rank")
    if override is not None:
        return override
    return _state().rank_in("ep") if _dist_ready() else 0


def set_expert_model_parallel_rank(rank):
    """Override the rank get_expert_model_parallel_rank returns."""
    _state().overrides["ep_rank"] = rank


def get_expert_tensor_parallel_group(check_initialized=True):
    """The expert-tensor-parallel group: ranks that split one expert's weights (etp ranks)."""
    return _state().group("expt-tp", check_initialized)


def get_expert_tensor_parallel_world_size():
    """Expert-tensor-parallel size etp (or the value set).

    Before initialization, the value set by set_tensor_model_parallel_world_size (or None), as
    megatron-core does for backward compatibility.
    """
    state = _state()
    override = state.overrides.get("etp_size")
    if override is not None:
        return override
    if "expt-tp" not in state.groups:
        return state.overrides.get("tp_size")
    return state.size_of("expt-tp")


def set_expert_tensor_parallel_world_size(world_size):
    """Override the size get_expert_tensor_parallel_world_size returns."""
    _state().overrides["etp_size"] = world_size


def get_expert_tensor_parallel_rank():
    """This rank's index in its expert-tensor-parallel group (or the value set).

    Before initialization, the value set by set_tensor_model_parallel_rank (or None).
    """
    state = _state()
    override = state.overrides.get("etp_rank")
    if override is not None:
        return override
    if "expt-tp" not in state.groups:
        return state.overrides.get("tp_rank")
    return state.rank_in("expt-tp")


def set_expert_tensor_parallel_rank(rank):
    """Override the rank get_expert_tensor_parallel_rank returns."""
    _state().overrides["etp_rank"] = rank


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    """The expert tensor x expert model group (etp * ep ranks; MoE token dispatch)."""
    return _state().group("tp-ep", check_initialized)


def get_expert_tensor_and_model_parallel_world_size():
    """etp * ep; 0 without torch.distributed."""
    return _state().size_of("tp-ep") if _dist_ready() else 0


def get_expert_tensor_and_model_parallel_rank():
    """This rank's index in its expert tensor x model group; 0 without torch.distributed."""
    return _state().rank_in("tp-ep") if _dist_ready() else 0


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True, with_egtp_remat=False):
    """The expert tensor x model x pipeline group (etp * ep * pp ranks). ``with_egtp_remat``
    (0.19) would merge the expert weight-remat ranks in: the same group at remat size 1."""
    return _state().group("tp-ep-pp", check_initialized)


def get_expert_data_parallel_group(
    check_initialized=True, partial_expert_data_parallel=False, *, with_gtp_remat=True
):
    """Replicas of the same expert shard: world / (etp * ep * pp) ranks, context folded in.

    Args:
        check_initialized: raise if there is no such group (False: return None).
        partial_expert_data_parallel: only this rank's distributed-optimizer instance's part.
        with_gtp_remat: (megatron-core 0.19) include the expert weight-remat ranks; the same
            group at remat size 1.
    """
    return _state().group(_expert_dp_kind(partial_expert_data_parallel), check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    """Deprecated name of get_expert_data_parallel_group (warns as megatron-core 0.16 does)."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, please use "
        "get_expert_data_parallel_group instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    """A gloo group over the same ranks as get_expert_data_parallel_group."""
    state = _state()
    kind = _expert_dp_kind(partial_expert_data_parallel)
    if kind not in state.gloo_groups:
        if state.initialized:
            raise MegatronCoreError(
                f"{kind} gloo group was not created: initialize_model_parallel was called with "
                f"create_gloo_process_groups=False"
            )
        state.group(kind)  # raises "not initialized"
    return state.gloo_groups[kind]


def get_expert_data_parallel_rank(partial_expert_data_parallel=False, *, with_gtp_remat=True):
    """This rank's index in its expert data-parallel group; 0 without torch.distributed."""
    kind = _expert_dp_kind(partial_expert_data_parallel)
    return _state().rank_in(kind) if _dist_ready() else 0


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False, *, with_gtp_remat=True):
    """Expert data-parallel size world / (etp * ep * pp); 0 without torch.distributed."""
    kind = _expert_dp_kind(partial_expert_data_parallel)
    return _state().size_of(kind) if _dist_ready() else 0


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """All ranks of this rank's distributed-optimizer instance (the world with one instance)."""
    return _state().group("intra-dist-opt", check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """The same shard across the distributed-optimizer instances (needs more than one instance)."""
    return _state().group("inter-dist-opt", check_initialized)


def get_all_ranks():
    """ "tp_dp_cp_pp_ep": this rank's index in each of those groups, joined by '_'."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(r or 0) for r in ranks)


# --- extensions: older megatron-core names ---------------------------------------------------


def get_tensor_and_expert_parallel_group(check_initialized=True):
    """Older name of get_expert_tensor_and_model_parallel_group (not in 0.16)."""
    return get_expert_tensor_and_model_parallel_group(check_initialized)


def get_tensor_and_expert_parallel_world_size():
    """Older name of get_expert_tensor_and_model_parallel_world_size (not in 0.16)."""
    return get_expert_tensor_and_model_parallel_world_size()


def get_data_modulo_expert_parallel_rank(partial_expert_data_parallel=False):
    """Older name of get_expert_data_parallel_rank (not in 0.16)."""
    return get_expert_data_parallel_rank(partial_expert_data_parallel)


def get_data_modulo_expert_parallel_world_size(partial_expert_data_parallel=False):
    """Older name of get_expert_data_parallel_world_size (not in 0.16)."""
    return get_expert_data_parallel_world_size(partial_expert_data_parallel)


# --- megatron-core 0.19: expert generalized-TP weight-remat group (size 1 here) ------------------


def get_expert_gtp_weight_remat_group(check_initialized=True):
    """This rank's expert weight-remat group (megatron-core 0.19): just this rank."""
    return _state().group("expt-gtp-remat", check_initialized)


def get_expert_gtp_weight_remat_world_size():
    """Size of the expert weight-remat group (1); 0 without torch.distributed or the group."""
    return _size_or_zero("expt-gtp-remat")


def get_expert_gtp_weight_remat_rank():
    """This rank's index in its expert weight-remat group (0)."""
    return _rank_or_zero("expt-gtp-remat")


def get_expert_gtp_weight_remat_global_ranks(check_initialized=True):
    """Global ranks of this rank's expert weight-remat group; None if there is none and
    ``check_initialized`` is False."""
    return _global_ranks_or_none("expt-gtp-remat", check_initialized)
