"""Delayed weight gradients for the parallel linear layers (``config.delay_wgrad_compute``).

With ``delay_wgrad_compute`` a layer's backward computes only the input (and bias) gradient; the
weight gradient waits until the layer's ``backward_dw()``, which a schedule calls later to overlap
it with communication (Transformer Engine's semantics, which megatron-core relies on; its own
non-TE layers ignore the option). See NOTE [ Delayed weight gradient ].

# NOTE [ Delayed weight gradient ]
#
# 1. Forward runs the ordinary linear function on ``weight.detach()``: autograd computes and
#    communicates the input gradient exactly as without delay and computes no weight gradient.
# 2. The layer keeps each forward's input (this rank's sequence shard under sequence parallelism)
#    and an identity autograd function on the output records the output gradient dY when
#    backward reaches it. Several forwards before one backward_dw (micro-batches) queue up.
# 3. backward_dw() takes every recorded (input, dY) pair, all-gathers the input along dim 0 under
#    sequence parallelism (a collective over the layer's group: every rank calls backward_dw),
#    and adds dY^T X, summed over leading dims, into ``weight.main_grad`` with
#    gradient_accumulation_fusion, else into ``weight.grad``: the gradient backward would have
#    produced (computed in fp32, cast to the gradient's dtype).
# 4. A forward whose output gradient never arrived (no backward yet) stays queued; backward_dw
#    leaves it for the next call. ``discard()`` drops everything (e.g. after an aborted step).
# 5. Activation recompute: a reentrant checkpoint runs forward without grad (nothing queued) and
#    recomputes inside backward, where the recomputed output's gradient arrives; a non-reentrant
#    one queues the first forward (whose gradient arrives) and recomputes inside backward a
#    graph that never sees a gradient. So an entry recorded during a backward pass that still
#    has no gradient when backward_dw runs is a discarded recompute, and is dropped.
"""

from __future__ import annotations

import torch

from megatron_core import compat
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["WgradStore"]


def _in_backward() -> bool:
    """True inside an autograd backward pass (e.g. an activation recompute)."""
    return compat.current_graph_task_id() != -1


class _RecordOutputGrad(torch.autograd.Function):
    """Identity forward; backward records the output gradient in ``entry`` and passes it on."""

    @staticmethod
    def forward(ctx, output, entry):
        ctx.entry = entry
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.entry["grad_output"] = grad_output
        return grad_output, None


class WgradStore:
    """The queue of one layer's pending weight gradients (NOTE [ Delayed weight gradient ]).

    Args:
        tp_group: the layer's tensor-parallel group (for the sequence-parallel all-gather).
        sequence_parallel: the layer's inputs are sequence shards to gather before the product.
    """

    def __init__(self, tp_group, sequence_parallel: bool):
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.pending: list[dict] = []

    def record(self, input_: torch.Tensor, output: torch.Tensor, weight) -> torch.Tensor:
        """Queue ``input_`` ([..., in]) for ``weight`` ([out, in]) and return ``output``
        ([..., out]) wrapped so that its gradient is recorded (rule 2). Outside grad mode
        nothing is queued."""
        if not torch.is_grad_enabled() or not output.requires_grad:
            return output
        entry = {"input": input_.detach(), "weight": weight, "grad_output": None}
        entry["in_backward"] = _in_backward()
        self.pending.append(entry)
        return _RecordOutputGrad.apply(output, entry)

    @torch.no_grad()
    def compute(self, fused: bool) -> None:
        """Add every ready entry's dY^T X into its weight's ``main_grad`` (``fused``) or
        ``grad`` (rule 3); entries without an output gradient stay queued (rule 4)."""
        ready = [e for e in self.pending if e["grad_output"] is not None]
        self.pending = [
            e for e in self.pending if e["grad_output"] is None and not e["in_backward"]
        ]  # rule 5
        for entry in ready:
            total_input = entry["input"]
            if self.sequence_parallel:
                total_input = gather_from_sequence_parallel_region(total_input, group=self.tp_group)
            grad_output, weight = entry["grad_output"], entry["weight"]
            wgrad = torch.matmul(
                grad_output.reshape(-1, grad_output.shape[-1]).t().float(),
                total_input.reshape(-1, total_input.shape[-1]).float(),
            )
            if fused:
                weight.main_grad.add_(wgrad.to(weight.main_grad.dtype))
            elif weight.grad is None:
                weight.grad = wgrad.to(weight.dtype)
            else:
                weight.grad.add_(wgrad.to(weight.grad.dtype))

    def discard(self) -> None:
        """Drop every queued entry without computing it."""
        self.pending = []
