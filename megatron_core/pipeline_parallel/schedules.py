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
``set_input_tensor`` and carry their ``config`` (pipeline_dtype, hidden_size, sequence_parallel).

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

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel._steps import (
    backward_step,
    check_schedule_args,
    communicator,
    custom_backward,
    deallocate_output_tensor,
    finalize,
    forward_step,
    get_model_config,
    get_tensor_shapes,
    no_sync_context,
    one_chunk,
    option,
    parallel_sizes,
    set_input_tensor,
)
from megatron_core.pipeline_parallel.interleaved import (
    forward_backward_pipelining_with_interleaving,
)
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator

__all__ = [
    "get_forward_backward_func",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
    "deallocate_output_tensor",
    "custom_backward",
    "forward_step",
    "backward_step",
    "get_tensor_shapes",
    "set_input_tensor",
]


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None):
    """The schedule for this pipeline: no pipelining (pp == 1), 1F1B, or interleaved 1F1B.

    Args:
        pp_size: pipeline size; with ``vp_size`` both None, both come from parallel_state.
        vp_size: virtual pipeline size (model chunks per stage), None for no interleaving.
    """
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
):
    """Run ``num_microbatches`` forward (and backward) passes on one stage, no communication.

    Gradients accumulate over the microbatches; under ``config.no_sync_func`` all but the last
    backward skip the data-parallel sync. ``seq_length``/``micro_batch_size`` are unused.

    Returns:
        list of ``loss_func``'s dicts, one per microbatch.
    """
    model = one_chunk(model, "model")
    data_iterator = one_chunk(data_iterator, "data_iterator")
    config = get_model_config(model)
    check_schedule_args(
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        config=config,
        pp_size=1,
    )
    _, cp_size = parallel_sizes(pg_collection)
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
            cp_size,
            collect_non_loss_data,
            is_first_microbatch=i == 0,
            current_microbatch=i,
        )
        total_tokens += tokens
        if not forward_only:
            backward_step(None, output, None, config)

    with no_sync_context(config)():
        for i in range(num_microbatches - 1):
            one(i)
    one(num_microbatches - 1)
    finalize(config, [model], total_tokens, forward_only)
    return store


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
):
    """1F1B over the pipeline (NOTE [ 1F1B ]): this rank runs its stage's part of every
    microbatch, exchanging [s, b, h] activations and gradients with its neighbours.

    Returns:
        on the last stage, the list of ``loss_func``'s dicts (one per microbatch); else [].
    """
    model = one_chunk(model, "model")
    data_iterator = one_chunk(data_iterator, "data_iterator")
    config = get_model_config(model)
    tp_size, cp_size = parallel_sizes(pg_collection)
    check_schedule_args(
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        config=config,
        pp_size=2,
        tp_size=tp_size,
    )
    p2p = communicator(p2p_communicator, pg_collection, config)
    shape = get_tensor_shapes(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        config=config,
        tp_size=tp_size,
        cp_size=cp_size,
    )[0]
    if adjust_tensor_shapes_fn is not None:
        recv, send = adjust_tensor_shapes_fn([shape], [shape])
        shape = recv[0]
    first, last = p2p.is_pp_first_stage, p2p.is_pp_last_stage
    warmup = min(p2p.pp_size - p2p.pp_rank - 1, num_microbatches)
    remaining = num_microbatches - warmup
    deallocate = option(config, "deallocate_pipeline_outputs", False)
    store: list = []
    total_tokens = torch.tensor(0, dtype=torch.int)
    inputs: list = []
    outputs: list = []

    def run_forward(i: int, input_tensor):
        nonlocal total_tokens
        output, tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            input_tensor,
            store,
            config,
            cp_size,
            collect_non_loss_data,
            is_first_microbatch=i == 0,
            current_microbatch=i,
            is_last_stage=last,
        )
        total_tokens += tokens
        return output

    def run_backward(output_grad):
        input_tensor, output = inputs.pop(0), outputs.pop(0)
        return backward_step(input_tensor, output, output_grad, config)

    sync_off = no_sync_context(config)()
    sync_off.__enter__()
    try:
        for i in range(warmup):  # NOTE [ 1F1B ], rule 1
            input_tensor = p2p.recv_forward(shape, first)
            output = run_forward(i, input_tensor)
            p2p.send_forward(output, last)
            if not forward_only:
                inputs.append(input_tensor)
                outputs.append(output)
                deallocate_output_tensor(output, deallocate)
        input_tensor = p2p.recv_forward(shape, first) if remaining > 0 else None
        for k in range(remaining):  # rule 2
            final = k == remaining - 1
            output = run_forward(k + warmup, input_tensor)
            if forward_only:
                p2p.send_forward(output, last)
                input_tensor = None if final else p2p.recv_forward(shape, first)
                continue
            output_grad = p2p.send_forward_recv_backward(output, shape, last)
            inputs.append(input_tensor)
            outputs.append(output)
            deallocate_output_tensor(output, deallocate)
            if final and warmup == 0:
                sync_off.__exit__(None, None, None)
                sync_off = None
            input_grad = run_backward(output_grad)
            if final:
                input_tensor = None
                p2p.send_backward(input_grad, first)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_grad, shape, first)
        if not forward_only:
            for i in range(warmup):  # rule 3
                if i == warmup - 1 and sync_off is not None:
                    sync_off.__exit__(None, None, None)
                    sync_off = None
                output_grad = p2p.recv_backward(shape, last)
                p2p.send_backward(run_backward(output_grad), first)
    finally:
        if sync_off is not None:
            sync_off.__exit__(None, None, None)
    finalize(config, [model], total_tokens, forward_only)
    return store
