"""Megatron-compatible getters and setters for pipeline stages, virtual stages and embeddings.

Re-exported by :mod:`megatron_core.parallel_state`; conventions as in getters_dense.py.
``is_pipeline_first_stage`` and friends follow megatron-core 0.16: ``ignore_virtual`` defaults to
True, and a caller that asks about virtual stages passes ``vp_stage`` (the model chunk) itself.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.state import _state

__all__ = [
    "get_pipeline_model_parallel_group",
    "set_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_world_size",
    "set_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "set_virtual_pipeline_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_world_size",
    "set_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_rank",
    "get_embedding_group",
    "get_position_embedding_group",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    # extension (not in megatron-core 0.16)
    "get_pipeline_model_parallel_split_rank",
]


def get_pipeline_model_parallel_group(check_initialized=True):
    """The pipeline group of this rank (one rank per stage, stage order)."""
    return _state().group("pp", check_initialized)


def set_pipeline_model_parallel_world_size(world_size):
    """Override the number of stages get_pipeline_model_parallel_world_size returns."""
    _state().overrides["pp_size"] = world_size


def get_pipeline_model_parallel_world_size():
    """Number of pipeline stages pp (or the value set)."""
    override = _state().overrides.get("pp_size")
    return override if override is not None else _state().size_of("pp")


def set_pipeline_model_parallel_rank(rank):
    """Override the stage get_pipeline_model_parallel_rank returns."""
    _state().overrides["pp_rank"] = rank


def get_pipeline_model_parallel_rank():
    """This rank's stage index in [0, pp) (or the value set)."""
    override = _state().overrides.get("pp_rank")
    return override if override is not None else _state().rank_in("pp")


def _pipeline_ranks() -> list[int]:
    return _state().member_ranks("pp")


def get_pipeline_model_parallel_first_rank():
    """Global rank of the first stage of this rank's pipeline."""
    return _pipeline_ranks()[0]


def get_pipeline_model_parallel_last_rank():
    """Global rank of the last stage (index pipeline world size - 1) of this rank's pipeline."""
    return _pipeline_ranks()[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (wraps from the last stage to the first)."""
    ranks = _pipeline_ranks()
    step = get_pipeline_model_parallel_rank() + 1
    return ranks[step % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage (wraps from the first stage to the last)."""
    ranks = _pipeline_ranks()
    step = get_pipeline_model_parallel_rank() - 1
    return ranks[step % get_pipeline_model_parallel_world_size()]


def _virtual_stage_allows(ignore_virtual, vp_stage, wanted_stage) -> bool:
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if ignore_virtual or vpp is None:
        return True
    if vp_stage is None:
        raise MegatronCoreError(
            "vp_stage must be passed if virtual pipeline is enabled "
            f"(virtual_pipeline_model_parallel_size={vpp}) and ignore_virtual=False"
        )
    return vp_stage == wanted_stage(vpp)


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """True on stage 0 (and, with ignore_virtual=False under virtual pipelining, on chunk 0).

    Args:
        ignore_virtual: only look at the physical stage (megatron-core 0.16's default).
        vp_stage: the model chunk asked about; required when ignore_virtual is False and
            virtual pipelining is on.
    """
    if not _virtual_stage_allows(ignore_virtual, vp_stage, lambda vpp: 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """True on the last stage (and, with ignore_virtual=False, on the last chunk ``vp_stage``)."""
    if not _virtual_stage_allows(ignore_virtual, vp_stage, lambda vpp: vpp - 1):
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def set_virtual_pipeline_model_parallel_world_size(world_size):
    """Set the number of model chunks per stage (None turns virtual pipelining off)."""
    _state().virtual_pipeline_model_parallel_size = world_size


def get_virtual_pipeline_model_parallel_world_size():
    """Model chunks per stage (None without virtual pipelining)."""
    return _state().virtual_pipeline_model_parallel_size


def set_virtual_pipeline_model_parallel_rank(rank):
    """Set the current model chunk (deprecated in megatron-core 0.16: pass vp_stage instead)."""
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
        "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
        DeprecationWarning,
        stacklevel=2,
    )
    _state().virtual_pipeline_model_parallel_rank = rank


def get_virtual_pipeline_model_parallel_rank():
    """The model chunk last set (0 after initialize with virtual pipelining, else None)."""
    return _state().virtual_pipeline_model_parallel_rank


def get_embedding_group(check_initialized=True):
    """The ranks sharing the word embedding (first and last stage by default) of this pipeline."""
    return _state().group("embedding", check_initialized)


def get_position_embedding_group(check_initialized=True):
    """The ranks sharing the position embedding (first stage by default) of this pipeline."""
    return _state().group("position_embedding", check_initialized)


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """True if this rank holds a copy of the word embedding (False before initialization).

    With ignore_virtual=False, the first/last rank of the group count only on their first/last
    virtual chunk ``vp_stage``.
    """
    ranks = _state().ranks.get("embedding")
    if ranks is None or dist.get_rank() not in ranks:
        return False
    rank = dist.get_rank()
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group():
    """True if this rank holds a copy of the position embedding (False before initialization)."""
    ranks = _state().ranks.get("position_embedding")
    return ranks is not None and dist.get_rank() in ranks


def get_pipeline_model_parallel_split_rank():
    """The encoder/decoder split stage given to initialize_model_parallel, or None (not in 0.16)."""
    return _state().pipeline_model_parallel_split_rank
