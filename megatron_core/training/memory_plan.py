"""The main job's ``--memory-budget``: plan the recompute before the first iteration, train
with the plan, and measure the second iteration's peak against the prediction.

Every rank probes one microbatch of the first iteration's data (NOTE [ Recompute planner ] in
tensor_parallel/recompute/planner/; the optimizer's moments, not made yet, are counted as its
first step will make them), the plan is printed and applied to the model's layers, and the
second iteration (the first where the moments exist; the only one of a one-iteration run) runs
under the allocator timeline: its peak, the allocator's total with nothing subtracted (model and
optimizer states, the buffers kept from the first iteration, the data, the iteration's own
peak, the optimizer step included), is printed beside the prediction.
"""

from __future__ import annotations

import argparse

import torch

from megatron_core import device, parallel_state
from megatron_core.pipeline_parallel import get_tensor_shapes, interleaved_chunk_order
from megatron_core.tensor_parallel.recompute.planner import RecomputePlan, plan_recompute
from megatron_core.tensor_parallel.recompute.planner.probe import MemoryTimeline
from megatron_core.training.data import ByteCorpus, get_batch
from megatron_core.training.mixed_precision import MixedPrecisionOptimizer

__all__ = ["plan_to_budget", "stage_probe_forward", "measured_iteration"]

_MiB = 1 << 20


def plan_to_budget(
    args: argparse.Namespace, model, optimizer, corpus: ByteCorpus, step: int
) -> tuple[RecomputePlan, list[str]]:
    """Plan ``model``'s recompute for ``args.memory_budget`` on microbatch 0 of ``step`` (as the
    training step computes its loss, loss scaling included), apply it, and return the plan and
    the lines to print. Collective: every rank calls it."""
    tokens, labels = get_batch(corpus, args, step, 0)
    mixed = isinstance(optimizer, MixedPrecisionOptimizer)
    dp = parallel_state.get_data_parallel_world_size()
    num_microbatches = max(1, args.global_batch_size // (args.micro_batch_size * dp))

    def loss(output):
        scaled = output.mean() / num_microbatches
        return optimizer.scale_loss(scaled) if mixed else scaled

    interleaved = isinstance(model, torch.nn.ModuleList)  # this rank's chunks (vp of them)
    chunks = list(model) if interleaved else [model]
    forwards = [stage_probe_forward(c, tokens, labels, args.seq_length, loss) for c in chunks]
    schedule = None  # 1F1B's held microbatches, or none: the planner's default (NOTE [
    # Recompute planner ], rule 3); interleaved: the order the schedule runs the chunks in
    if interleaved:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        rank = parallel_state.get_pipeline_model_parallel_rank()
        schedule = interleaved_chunk_order(num_microbatches, pp, rank, len(chunks))
    plan = plan_recompute(
        model, forwards if interleaved else forwards[0],
        args.memory_budget, optimizer, microbatches=num_microbatches, schedule=schedule,
    )  # fmt: skip
    plan.apply(model)
    return plan, str(plan).splitlines()


def stage_probe_forward(model, tokens, labels, seq_length: int, loss=None):
    """The ``forward`` that :func:`plan_recompute` probes on this rank's model: our GPT, or one
    pipeline stage's chunk of it (NOTE [ Recompute planner ], rule 3).

    A stage after the first makes what it would receive for one microbatch: [s, b, h] hidden
    states of the schedule's p2p shape (``get_tensor_shapes``: the sequence split over context,
    and over tensor ranks under sequence parallelism), in the pipeline's dtype, on this rank's
    device. A stage before the last returns its output times a gradient-shaped tensor, summed;
    the last stage (or the whole model) returns ``loss(output)`` (default: the mean).

    Args:
        tokens, labels: one microbatch, [b, s / cp] (this rank's share of the sequence).
        seq_length: the whole sequence length (before the context-parallel split).
    """
    config = model.config
    first = getattr(model, "pre_process", True)
    last = getattr(model, "post_process", True)

    def forward():
        if not first:
            (shape,) = get_tensor_shapes(
                seq_length=seq_length, micro_batch_size=tokens.shape[0],
                decoder_seq_length=None, config=config,
            )  # fmt: skip
            dtype = config.pipeline_dtype or torch.float32
            model.set_input_tensor(
                torch.randn(shape, dtype=dtype, device=device.current_device(), requires_grad=True)
            )
        output = model(tokens if first else None, labels if last else None)
        if not last:
            return (output * torch.ones_like(output)).sum()
        return output.mean() if loss is None else loss(output)

    return forward


def measured_iteration(train_step, model, optimizer, plan: RecomputePlan) -> tuple[object, str]:
    """Run ``train_step()`` under the allocator timeline; its result and a line with the
    measured peak beside the prediction: the allocator's total at the peak, nothing subtracted
    (``max_memory_allocated`` after a reset on a GPU; on the CPU the census of what is alive
    as the step begins plus the allocator events' peak above it: NOTE [ The allocator's total
    on the CPU ], in device.py), or with ``activations_only`` the peak above the step's start."""
    optimizer.zero_grad(set_to_none=True)  # as the step begins: the timeline sees no older frees
    timeline = MemoryTimeline(total=not plan.activations_only)
    with timeline:
        result = train_step()
        timeline.mark("end")
    peak = timeline.start_total + max(peak for _, _, peak in timeline.points)
    scope = "activations" if plan.activations_only else "total"
    line = (
        f"memory ({scope}): predicted peak {plan.predicted_peak / _MiB:,.1f} MiB, measured "
        f"{peak / _MiB:,.1f} MiB ({(peak - plan.predicted_peak) / plan.predicted_peak:+.1%}), "
        f"budget {plan.budget / _MiB:,.1f} MiB"
    )
    return result, line
