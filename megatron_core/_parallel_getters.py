"""Megatron-compatible getters over the one ParallelState (re-exported by parallel_state).

Each getter reads :func:`megatron_core.parallel_state.get_parallel_state`, so every one of them
raises MegatronCoreError before ``initialize_model_parallel``. Ranks are global unless the name
says otherwise; ``*_rank`` without "global" is the index inside the group.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_core.parallel_state import get_parallel_state as _state
from megatron_core.parallel_state import model_parallel_is_initialized as _initialized

__all__ = [
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_global_ranks",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_split_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_src_rank",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_context_parallel_global_ranks",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_group",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_tensor_and_expert_parallel_group",
    "get_tensor_and_expert_parallel_world_size",
    "get_data_modulo_expert_parallel_group",
    "get_data_modulo_expert_parallel_rank",
    "get_data_modulo_expert_parallel_world_size",
    "get_embedding_group",
    "get_position_embedding_group",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
]


def _dp_kind(with_context_parallel: bool) -> str:
    return "dp-cp" if with_context_parallel else "dp"


# --- tensor model parallel -------------------------------------------------------------------


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The tensor-parallel group of this rank (ranks that split one layer's weights).

    Args:
        check_initialized: megatron-core's flag. True (default): raise MegatronCoreError before
            initialize_model_parallel, like every getter; False: return None then instead.
    """
    if not check_initialized and not _initialized():
        return None
    return _state().group("tp")


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group, in [0, tp)."""
    return _state().rank_in("tp")


def get_tensor_model_parallel_world_size() -> int:
    """Tensor-parallel size tp."""
    return _state().size_of("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group (the broadcast source)."""
    return _state().ranks["tp"][0]


def get_tensor_model_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's tensor-parallel group, in group order."""
    return list(_state().ranks["tp"])


# --- pipeline model parallel -----------------------------------------------------------------


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    """The pipeline group of this rank (one rank per stage)."""
    return _state().group("pp")


def get_pipeline_model_parallel_rank() -> int:
    """This rank's stage index in [0, pp)."""
    return _state().rank_in("pp")


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages pp."""
    return _state().size_of("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this rank's pipeline."""
    return _state().ranks["pp"][0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    return _state().ranks["pp"][-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wraps from the last stage to the first)."""
    ranks = _state().ranks["pp"]
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wraps from the first stage to the last)."""
    ranks = _state().ranks["pp"]
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_pipeline_model_parallel_split_rank() -> int | None:
    """The encoder/decoder split stage given to initialize_model_parallel, or None."""
    return _state().pipeline_model_parallel_split_rank


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """Current model chunk of the interleaved schedule (None without virtual pipelining)."""
    return _state().virtual_pipeline_model_parallel_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    """Set the current model chunk of the interleaved schedule."""
    _state().virtual_pipeline_model_parallel_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per stage (None without virtual pipelining)."""
    return _state().virtual_pipeline_model_parallel_size


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on stage 0 (and, unless ignore_virtual, on virtual chunk 0)."""
    state = _state()
    vpp = state.virtual_pipeline_model_parallel_size
    if not ignore_virtual and vpp is not None and state.virtual_pipeline_model_parallel_rank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last stage (and, unless ignore_virtual, on the last virtual chunk)."""
    state = _state()
    vpp = state.virtual_pipeline_model_parallel_size
    if (
        not ignore_virtual
        and vpp is not None
        and state.virtual_pipeline_model_parallel_rank != vpp - 1
    ):
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# --- data parallel ---------------------------------------------------------------------------


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The data-parallel group (replicas of the same model shard); with cp folded in if asked."""
    return _state().group(_dp_kind(with_context_parallel))


def get_data_parallel_group_gloo(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """A gloo group over the same ranks as get_data_parallel_group (for CPU-side collectives)."""
    state = _state()
    kind = _dp_kind(with_context_parallel)
    if kind not in state.gloo_groups:
        from megatron_core.errors import MegatronCoreError

        raise MegatronCoreError(
            "data-parallel gloo group was not created: initialize_model_parallel was called with "
            "create_gloo_process_groups=False"
        )
    return state.gloo_groups[kind]


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its data-parallel group."""
    return _state().rank_in(_dp_kind(with_context_parallel))


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Data-parallel size dp (dp * cp with context parallel folded in)."""
    return _state().size_of(_dp_kind(with_context_parallel))


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 in this rank's data-parallel group."""
    return _state().ranks[_dp_kind(with_context_parallel)][0]


# --- context parallel ------------------------------------------------------------------------


def get_context_parallel_group() -> dist.ProcessGroup:
    """The context-parallel group (ranks that split one sequence)."""
    return _state().group("cp")


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group."""
    return _state().rank_in("cp")


def get_context_parallel_world_size() -> int:
    """Context-parallel size cp."""
    return _state().size_of("cp")


def get_context_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's context-parallel group."""
    return list(_state().ranks["cp"])


# --- combined groups -------------------------------------------------------------------------


def get_model_parallel_group() -> dist.ProcessGroup:
    """The model-parallel group: tensor x pipeline ranks holding one full model copy."""
    return _state().group("mp")


def get_model_parallel_rank() -> int:
    """This rank's index in its model-parallel (tp x pp) group."""
    return _state().rank_in("mp")


def get_model_parallel_world_size() -> int:
    """tp * pp."""
    return _state().size_of("mp")


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    """The tensor x context parallel group."""
    return _state().group("tp-cp")


def get_tensor_and_context_parallel_rank() -> int:
    """This rank's index in its tensor x context parallel group."""
    return _state().rank_in("tp-cp")


def get_tensor_and_context_parallel_world_size() -> int:
    """tp * cp."""
    return _state().size_of("tp-cp")


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The tensor x data (x context) parallel group."""
    return _state().group("tp-dp-cp" if with_context_parallel else "tp-dp")


# --- expert parallel (NOTE [ Rank layout ], rule 4) ------------------------------------------


def get_expert_model_parallel_group() -> dist.ProcessGroup:
    """The expert-parallel group (ranks that hold different experts)."""
    return _state().group("ep")


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-parallel group."""
    return _state().rank_in("ep")


def get_expert_model_parallel_world_size() -> int:
    """Expert-parallel size ep."""
    return _state().size_of("ep")


def get_tensor_and_expert_parallel_group() -> dist.ProcessGroup:
    """The tensor x expert parallel group (MoE token dispatch)."""
    return _state().group("tp-ep")


def get_tensor_and_expert_parallel_world_size() -> int:
    """tp * ep."""
    return _state().size_of("tp-ep")


def get_data_modulo_expert_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """Replicas of the same expert: the data-parallel group with the expert axis taken out."""
    return _state().group("dp-cp-modulo-ep" if with_context_parallel else "dp-modulo-ep")


def get_data_modulo_expert_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its data-modulo-expert group."""
    return _state().rank_in("dp-cp-modulo-ep" if with_context_parallel else "dp-modulo-ep")


def get_data_modulo_expert_parallel_world_size(with_context_parallel: bool = False) -> int:
    """dp // ep (times cp with context parallel folded in)."""
    return _state().size_of("dp-cp-modulo-ep" if with_context_parallel else "dp-modulo-ep")


# --- embeddings (NOTE [ Rank layout ], rule 5) -----------------------------------------------


def get_embedding_group() -> dist.ProcessGroup:
    """First and last pipeline stage (plus the split stage): they share the word embedding."""
    return _state().group("embedding")


def get_position_embedding_group() -> dist.ProcessGroup:
    """First pipeline stage (plus the split stage): they share the position embedding."""
    return _state().group("position_embedding")


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """True if this rank holds a copy of the word embedding (megatron-core's rule).

    Unless ignore_virtual, the first/last stage count only on their first/last virtual chunk.
    """
    state = _state()
    ranks = state.ranks.get("embedding", [])
    rank = state.global_rank
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """True if this rank holds a copy of the position embedding."""
    state = _state()
    return state.global_rank in state.ranks.get("position_embedding", [])
