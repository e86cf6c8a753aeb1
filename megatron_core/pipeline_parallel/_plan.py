"""The interleaved schedule's plan, as pure functions: order table, warm-up counts, checks.

Re-exported by :mod:`megatron_core.pipeline_parallel.schedules` under megatron-core's names
(``get_schedule_table``, ``get_pp_rank_microbatches``). See NOTE [ Interleaved 1F1B ] in
interleaved.py for how the schedule uses them.
"""

from __future__ import annotations

from megatron_core import parallel_state
from megatron_core.errors import ConfigError, MegatronCoreError

__all__ = ["get_schedule_table", "get_pp_rank_microbatches"]


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> list[tuple[int, int]]:
    """The forward order of one stage: ``(microbatch_id, model_chunk_id)`` per virtual id.

    Microbatches go in groups of ``microbatch_group_size_per_vp_stage``: the group through
    chunk 0, then through chunk 1, ..., then the next group. A group that would reach or pass
    the end takes every remaining microbatch. Example, 5 microbatches, 2 chunks, groups of 3::

        virtual id   0 1 2 3 4 5 6 7 8 9
        microbatch   0 1 2 0 1 2 3 4 3 4
        chunk        0 0 0 1 1 1 0 0 1 1
    """
    group = microbatch_group_size_per_vp_stage
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group):
        stop = num_microbatches if start + group >= num_microbatches else start + group
        table.extend((i, c) for c in range(num_model_chunks) for i in range(start, stop))
    return table


def pp_rank_microbatches(
    num_microbatches: int,
    num_model_chunks: int,
    group_size: int,
    pp_size: int,
    pp_rank: int,
    vp_size: int | None,
    forward_only: bool = False,
    extra_warmup: bool = False,
) -> tuple[int, bool, int, int]:
    """(total, all in warm-up?, warm-up, remaining) forwards of stage ``pp_rank``.

    Interleaved: ``(pp - rank - 1) * 2 + (chunks - 1) * group_size`` warm-up forwards (+1 with
    ``extra_warmup``); 1F1B (``vp_size`` None): ``pp - rank - 1``; no pipeline: 0; forward-only:
    all. Capped at the total ``num_microbatches * num_model_chunks``.
    """
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pp_size > 1 and vp_size is None:
        warmup = pp_size - pp_rank - 1
    elif pp_size > 1:
        warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * group_size
        warmup += 1 if extra_warmup else 0
    else:
        warmup = 0
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_warmup, warmup, total - warmup


def get_pp_rank_microbatches(
    num_microbatches,
    num_model_chunks,
    microbatch_group_size_per_vp_stage,
    forward_only=False,
    overlap_moe_expert_parallel_comm=False,
    p2p_communicator=None,
):
    """(total, are all microbatches in warm-up, warm-up, remaining) for this pipeline rank.

    Sizes come from ``p2p_communicator`` (its group and its config's virtual pipeline size)
    or, without one, from parallel_state. ``overlap_moe_expert_parallel_comm`` adds one warm-up
    forward to the interleaved schedule (megatron-core's combined 1F1B, not run here).
    """
    if p2p_communicator is not None:
        pp_size = p2p_communicator.pp_group.size()
        pp_rank = p2p_communicator.pp_group.rank()
        vp_size = p2p_communicator.virtual_pipeline_model_parallel_size
    else:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return pp_rank_microbatches(
        num_microbatches,
        num_model_chunks,
        microbatch_group_size_per_vp_stage,
        pp_size,
        pp_rank,
        vp_size,
        forward_only,
        overlap_moe_expert_parallel_comm,
    )


def check_interleaved_config(config, num_microbatches: int, pp_size: int, group: int) -> None:
    """megatron-core's checks of an interleaved run, with its error types (ConfigError is a
    ValueError, MegatronCoreError a RuntimeError), before any communication."""
    if getattr(config, "overlap_p2p_comm", False) and getattr(config, "batch_p2p_comm", True):
        raise ConfigError(
            "interleaved schedule: overlap_p2p_comm (True) cannot be combined with "
            "batch_p2p_comm (True); set batch_p2p_comm=False"
        )
    if not pp_size <= group <= num_microbatches:
        raise ConfigError(
            f"interleaved schedule: microbatch_group_size_per_vp_stage ({group}) must lie in "
            f"[pipeline size ({pp_size}), num_microbatches ({num_microbatches})]"
        )
    final = num_microbatches % group
    if 0 < final < pp_size:
        raise MegatronCoreError(
            f"interleaved schedule: num_microbatches ({num_microbatches}) mod "
            f"microbatch_group_size_per_vp_stage ({group}) is {final}; it must be 0 or at "
            f"least the pipeline size ({pp_size}), else the last group stalls the pipeline"
        )
    if getattr(config, "overlap_p2p_comm_warmup_flush", False) and not getattr(
        config, "overlap_p2p_comm", False
    ):
        raise ConfigError(
            "interleaved schedule: overlap_p2p_comm_warmup_flush (True) needs "
            "overlap_p2p_comm=True and batch_p2p_comm=False"
        )
