"""Forward-backward schedules over the pipeline stages (megatron-core's ``schedules`` module).

``get_forward_backward_func()`` picks one of three functions from parallel_state's pipeline size
and virtual size. All take megatron-core's keyword arguments and return the list of the dicts
``loss_func`` returned, one per microbatch, on the last stage (an empty list elsewhere)::

    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=forward_step, data_iterator=data, model=model,
        num_microbatches=8, seq_length=s, micro_batch_size=b, forward_only=False,
    )

``forward_step_func(data_iterator, model)`` returns ``(output, loss_func)``; ``loss_func(output)``
returns ``(loss, {name: tensor})`` (loss averaged over the microbatches by the schedule) or
``(loss, num_tokens, {name: tensor})``. Model chunks take the received activation through
``set_input_tensor`` (always a list, as in megatron-core: ``[tensor]`` or ``[None]``) and carry
their ``config`` (pipeline_dtype, hidden_size, sequence_parallel).

# NOTE [ 1F1B ]
Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters"), Fig. 4:
1. Stage r of pp runs ``w = min(pp - r - 1, m)`` warm-up forwards (receive, forward, send).
2. Then ``m - w`` steady steps: forward microbatch i + w, send it while receiving the gradient of
   microbatch i (one combined exchange with the next stage), backward microbatch i, send its
   input gradient while receiving the next input (one exchange with the previous stage).
3. Then ``w`` cool-down backwards. Stage r thus holds at most ``w + 1 <= pp`` microbatches'
   activations at once, whatever m is (the first stage holds pp).
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, process_groups_config
from megatron_core.errors import ConfigError, MegatronCoreError
from megatron_core.pipeline_parallel._args import (
    check_schedule_args,
    communicator,
    finalize,
    get_tensor_shapes,
    no_sync_context,
    one_chunk,
    one_iteration,
    option,
    parallel_groups,
)
from megatron_core.pipeline_parallel._embedding import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
)
from megatron_core.pipeline_parallel._one_f_one_b import OneFOneB
from megatron_core.pipeline_parallel._plan import get_pp_rank_microbatches, get_schedule_table
from megatron_core.pipeline_parallel._steps import (
    backward_step,
    backward_step_multimodule,
    check_first_val_step,
    custom_backward,
    deallocate_output_tensor,
    forward_step,
    forward_step_calc_loss,
    get_model_config,
    get_tensor_device,
    set_current_microbatch,
    set_input_tensor,
)
from megatron_core.pipeline_parallel.interleaved import (
    forward_backward_pipelining_with_interleaving,
)
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator

Shape = list[int] | torch.Size  # megatron-core's alias for a p2p tensor shape

__all__ = [
    "Shape",
    "get_forward_backward_func",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
    "deallocate_output_tensor",
    "custom_backward",
    "set_current_microbatch",
    "forward_step_calc_loss",
    "forward_step",
    "backward_step",
    "backward_step_multimodule",
    "check_first_val_step",
    "clear_embedding_activation_buffer",
    "finish_embedding_wgrad_compute",
    "get_pp_rank_microbatches",
    "get_schedule_table",
    "get_tensor_shapes",
    "get_tensor_device",
    "set_input_tensor",
]


def get_forward_backward_func(
    pp_size: int | None = None, vp_size: int | None = None, schedule_pg_collection=None
):
    """The schedule for this pipeline: no pipelining (pp == 1), 1F1B, or interleaved 1F1B.

    Args:
        pp_size: pipeline size; with ``vp_size`` both None, both come from parallel_state.
        vp_size: virtual pipeline size (model chunks per stage), None for no interleaving.
        schedule_pg_collection: megatron-core 0.19's multi-module collection, which selects its
            bridge schedule; multi-module pipelines are not supported here (a clear error).
    """
    multi = getattr(process_groups_config, "MultiModuleProcessGroupCollection", None)
    if multi is not None and isinstance(schedule_pg_collection, multi):
        raise MegatronCoreError(
            "get_forward_backward_func: a MultiModuleProcessGroupCollection (megatron-core's "
            "multi-module bridge schedule) is not supported by this package"
        )
    if pp_size is None and vp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size is None or pp_size < 1:
        raise MegatronCoreError(f"get_forward_backward_func: pp_size ({pp_size}) must be >= 1")
    if pp_size == 1:
        return forward_backward_no_pipelining
    if vp_size is not None:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


@one_iteration
def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
):
    """Run ``num_microbatches`` forward (and backward) passes on one stage, no communication.

    Gradients accumulate over the microbatches; under ``config.no_sync_func`` all but the last
    backward skip the data-parallel sync. ``seq_length``/``micro_batch_size`` are unused.

    Returns:
        list of ``loss_func``'s dicts, one per microbatch.
    """
    model = one_chunk(model, "model")
    data_iterator = one_chunk(data_iterator, "data_iterator")
    if adjust_tensor_shapes_fn is not None:
        raise MegatronCoreError(
            "forward_backward_no_pipelining: adjust_tensor_shapes_fn is not supported without "
            "pipeline parallelism (as in megatron-core)"
        )
    config = get_model_config(model)
    check_schedule_args(
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        config=config,
        pp_size=1,
    )
    _, cp_group = parallel_groups(pg_collection)
    store: list = []
    total_tokens = torch.tensor(0, dtype=torch.int)

    def one(i: int) -> None:
        nonlocal total_tokens
        output, tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            None,
            store,
            config,
            cp_group.size(),
            collect_non_loss_data,
            is_first_microbatch=check_first_val_step(first_val_step, forward_only, i == 0),
            current_microbatch=i,
        )
        total_tokens += tokens
        if not forward_only:
            backward_step(None, output, None, None, config)

    with no_sync_context(config)():
        for i in range(num_microbatches - 1):
            one(i)
    one(num_microbatches - 1)
    finalize(config, [model], total_tokens, forward_only, pg_collection, force_all_reduce)
    return store


@one_iteration
def forward_backward_pipelining_without_interleaving(
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
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
):
    """1F1B over the pipeline (NOTE [ 1F1B ]): this rank runs its stage's part of every
    microbatch, exchanging [s, b, h] activations and gradients with its neighbours.

    Returns:
        on the last stage, the list of ``loss_func``'s dicts (one per microbatch); else [].

    Raises:
        ConfigError: (a ValueError, as megatron-core raises) ``config.overlap_p2p_comm`` (1F1B
            does not overlap), before any communication.
        MegatronCoreError: the checks every schedule makes, before any communication.
    """
    model = one_chunk(model, "model")
    data_iterator = one_chunk(data_iterator, "data_iterator")
    config = get_model_config(model)
    if option(config, "overlap_p2p_comm", False):
        raise ConfigError(
            "forward_backward_pipelining_without_interleaving: overlap_p2p_comm (True) is not "
            "supported by the non-interleaved schedule (as in megatron-core)"
        )
    tp_group, cp_group = parallel_groups(pg_collection)
    p2p = communicator(p2p_communicator, pg_collection, config)
    check_schedule_args(
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        config=config,
        pp_size=p2p.pp_size,
        tp_size=tp_group.size(),
    )
    shapes = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, config=config)
    recv = get_tensor_shapes(
        **shapes, decoder_seq_length=decoder_seq_length, tp_group=tp_group, cp_group=cp_group
    )
    send = list(recv)
    if adjust_tensor_shapes_fn is not None:
        recv, send = adjust_tensor_shapes_fn(recv, send)
    deferred = None
    if not forward_only and option(config, "finalize_model_grads_func") is not None:
        deferred = clear_embedding_activation_buffer(config, model, p2p.is_pp_last_stage)
    run = OneFOneB(forward_step_func, data_iterator, model, num_microbatches, config, p2p)
    run.execute(recv, send, cp_group.size(), forward_only, collect_non_loss_data, first_val_step)
    if not forward_only and option(config, "finalize_model_grads_func") is not None:
        finish_embedding_wgrad_compute(config, deferred, p2p.is_pp_last_stage, tp_group)
    finalize(config, [model], run.total_tokens, forward_only, pg_collection, force_all_reduce)
    return run.store
