"""Interleaved 1F1B: each stage holds ``vp`` model chunks (virtual pipeline stages).

# NOTE [ Interleaved 1F1B ]
Narayanan et al. 2021, Fig. 4 (bottom) and section 2.2.2. With pp stages and vp chunks per
stage, chunk c of stage r is virtual stage ``c * pp + r`` of a pipeline of ``pp * vp`` stages; the
last stage's chunk c feeds the first stage's chunk c + 1 (the p2p ring).
1. Order (megatron-core's ``get_schedule_table``): forwards go in groups of
   ``microbatch_group_size_per_vp_stage`` microbatches (default pp): the group through chunk 0,
   then chunk 1, ..., then the next group; the last group takes whatever remains. Backward k
   runs the microbatch of forward k through the mirrored chunk ``vp - 1 - c``. Any m works whose
   group size lies in [pp, m] and whose last group is empty or at least pp microbatches.
2. Warm-up (``get_pp_rank_microbatches``): ``(pp - r - 1) * 2 + (vp - 1) * group`` forwards,
   capped at ``m * vp`` (all of them forward-only); then steady steps of one forward and one
   backward; then cool-down backwards.
3. Alignment. Stage r's k-th exchange pairs with its neighbours' k-th exchange. The first stage
   receives, at its forward k, the output the last stage produced at its forward k - (pp - 1)
   (chunk c - 1 of a microbatch its chunk c runs later), and nothing when that is the model's
   final chunk; the last stage's backward mirrors this. The first stage can thus hold several
   received inputs per chunk: a forward takes its input by microbatch id, less the inputs
   already released.
4. ``overlap_p2p_comm`` (needs ``batch_p2p_comm=False``): each steady step posts its forward
   send/receive right after the forward and its backward send/receive right after the backward,
   without waiting; a receive is waited for just before the forward (backward) that reads it,
   a send just before the next send in its direction. The exchange thus runs while the other
   half of the step computes. ``overlap_p2p_comm_warmup_flush`` does the same in warm-up and
   cool-down (non-edge stages post the receive for step k + 1 before computing step k).
5. Bubble: (pp - 1) / (vp * m + pp - 1) instead of 1F1B's (pp - 1) / (m + pp - 1).
"""

from __future__ import annotations

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel._args import (
    check_schedule_args,
    communicator,
    finalize,
    no_sync_context,
    one_iteration,
    option,
    parallel_groups,
    tensor_shape,
)
from megatron_core.pipeline_parallel._embedding import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
)
from megatron_core.pipeline_parallel._interleaved_run import InterleavedRun
from megatron_core.pipeline_parallel._plan import (
    check_interleaved_config,
    get_schedule_table,
    pp_rank_microbatches,
)
from megatron_core.pipeline_parallel._steps import get_model_config

__all__ = [
    "forward_backward_pipelining_with_interleaving",
    "interleaved_chunk_order",
    "interleaved_warmup_microbatches",
]


def interleaved_warmup_microbatches(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vp_size: int,
    forward_only: bool = False,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> int:
    """Forwards stage ``pp_rank`` runs before its first backward (NOTE [ Interleaved 1F1B ], 2)."""
    group = microbatch_group_size_per_vp_stage or pp_size
    return pp_rank_microbatches(
        num_microbatches, vp_size, group, pp_size, pp_rank, vp_size, forward_only
    )[2]


def interleaved_chunk_order(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vp_size: int,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> list[tuple[bool, int]]:
    """The order in which stage ``pp_rank`` runs its chunks' forwards and backwards in one
    training step of the interleaved schedule: ``(True, c)`` for a forward of chunk ``c``,
    ``(False, c)`` for a backward, ``num_microbatches * vp_size`` of each (NOTE [ Interleaved
    1F1B ]: the warm-up forwards, then one forward and one backward at a time, then the
    remaining backwards; backwards run the chunks mirrored). What the recompute planner reads
    to know which chunks' microbatches a stage holds at each point (NOTE [ Recompute planner
    ], rule 3)."""
    group = microbatch_group_size_per_vp_stage or pp_size
    chunk_of = [c for _, c in get_schedule_table(num_microbatches, vp_size, group)]
    total, _, warmup, remaining = pp_rank_microbatches(
        num_microbatches, vp_size, group, pp_size, pp_rank, vp_size
    )
    order = [(True, chunk_of[k]) for k in range(warmup)]
    for k in range(remaining):
        order += [(True, chunk_of[warmup + k]), (False, vp_size - 1 - chunk_of[k])]
    order += [(False, vp_size - 1 - chunk_of[k]) for k in range(remaining, total)]
    return order


def _check_chunks(model, data_iterator) -> None:
    if not isinstance(model, (list, tuple)) or not model:
        raise MegatronCoreError(
            "interleaved schedule: model must be a non-empty list of model chunks (one per "
            f"virtual stage), got {type(model).__name__}"
        )
    if not all(isinstance(chunk, torch.nn.Module) for chunk in model):
        raise MegatronCoreError("interleaved schedule: every model chunk must be a Module")
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != len(model):
        got = len(data_iterator) if isinstance(data_iterator, (list, tuple)) else "not a list"
        raise MegatronCoreError(
            f"interleaved schedule: data_iterator must be a list with one iterator per model "
            f"chunk ({len(model)}), got {got}"
        )


@one_iteration
def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
):
    """Interleaved 1F1B (NOTE [ Interleaved 1F1B ]) over ``len(model)`` chunks per stage.

    ``model`` and ``data_iterator`` are lists, one entry per chunk (vp_stage 0, 1, ...). Every
    exchange carries [s, b, h] activations or gradients, s = ``seq_length`` (``s / tp`` under SP;
    exchanged shapes with ``config.variable_seq_lengths``). ``decoder_seq_length`` is accepted
    and unused, as in megatron-core (its interleaved schedule sizes by ``seq_length`` alone).

    Returns:
        on the last stage, ``loss_func``'s dicts (one per microbatch); else [].

    Raises:
        MegatronCoreError: (a RuntimeError / AssertionError) or ConfigError (also a ValueError),
            as megatron-core raises them, before any communication: model / data_iterator not
            lists of equal length, ``adjust_tensor_shapes_fn`` given, ``overlap_p2p_comm`` with
            ``batch_p2p_comm``, a group size outside [pp, m], a last group of 1..pp-1
            microbatches.
    """
    tp_group, cp_group = parallel_groups(pg_collection)
    p2p = communicator(p2p_communicator, pg_collection, None)
    pp = p2p.pp_size
    _check_chunks(model, data_iterator)
    if adjust_tensor_shapes_fn is not None:
        raise MegatronCoreError(
            "interleaved schedule: adjust_tensor_shapes_fn is not supported (as in megatron-core)"
        )
    config = get_model_config(model[0])
    p2p.config = config if p2p.config is None else p2p.config
    check_schedule_args(
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        config=config,
        pp_size=pp,
        tp_size=tp_group.size(),
    )
    group = option(config, "microbatch_group_size_per_vp_stage") or pp
    check_interleaved_config(p2p.config, num_microbatches, pp, group)
    # decoder_seq_length unused: megatron-core's interleaved schedule sizes by seq_length alone
    shape = tensor_shape(
        seq_length, micro_batch_size, None, config, tp_group.size(), cp_group.size()
    )
    deferred = None
    if not forward_only and option(config, "finalize_model_grads_func") is not None:
        deferred = clear_embedding_activation_buffer(config, list(model), p2p.is_pp_last_stage)
    run = InterleavedRun(
        forward_step_func, list(data_iterator), list(model), num_microbatches, config, p2p
    )
    run.setup(shape, group, cp_group.size(), forward_only, collect_non_loss_data, first_val_step)
    with_sync = no_sync_context(config)
    run.execute(with_sync)
    if not forward_only and option(config, "finalize_model_grads_func") is not None:
        finish_embedding_wgrad_compute(config, deferred, p2p.is_pp_last_stage, tp_group)
    finalize(config, list(model), run.total_tokens, forward_only, pg_collection, force_all_reduce)
    return run.store
