"""Interleaved 1F1B: each stage holds ``vp`` model chunks (virtual pipeline stages).

# NOTE [ Interleaved 1F1B ]
Narayanan et al. 2021, Fig. 4 (bottom) and section 2.2.2. With pp stages and vp chunks per
stage, chunk c of stage r is virtual stage ``c * pp + r`` of a pipeline of ``pp * vp`` stages; the
last stage's chunk c feeds the first stage's chunk c + 1 (the p2p ring).
1. Order. Each stage runs ``m * vp`` forwards in groups of pp microbatches: microbatches
   ``g*pp .. g*pp+pp-1`` through chunk 0, then the same through chunk 1, ..., then the next group.
   Virtual id k -> chunk ``(k mod pp*vp) // pp`` (backwards run the chunks in reverse), microbatch
   ``(k // (pp*vp)) * pp + k mod pp``. This needs m divisible by pp (megatron-core's tunable
   ``microbatch_group_size_per_vp_stage`` other than pp is not supported here).
2. Warm-up: ``min((pp - r - 1) * 2 + (vp - 1) * pp, m * vp)`` forwards (all of them when m == pp
   or forward_only); then steady steps of one forward and one backward, each step ending in ONE
   exchange with both neighbours; then cool-down backwards.
3. Alignment. Stage r's k-th exchange pairs with its neighbours' k-th exchange. The first stage
   receives, at its forward k, the output the last stage produced at its forward k - (pp - 1)
   (which is chunk c - 1 of the microbatch that the first stage's chunk c runs next), and
   nothing when that would be the model's final chunk; the last stage's backward mirrors this.
4. Bubble: (pp - 1) / (vp * m + pp - 1) instead of 1F1B's (pp - 1) / (m + pp - 1).
5. Differences from megatron-core 0.16: ``overlap_p2p_comm`` is ignored (every exchange waits
   before the next compute, so stages run in lock-step with their neighbours; BENCHMARKS.md
   shows the cost), ``adjust_tensor_shapes_fn`` and ``variable_seq_lengths`` are refused.
"""

from __future__ import annotations

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel._steps import (
    backward_step,
    check_schedule_args,
    communicator,
    deallocate_output_tensor,
    finalize,
    forward_step,
    get_model_config,
    get_tensor_shapes,
    option,
    parallel_sizes,
)

__all__ = ["forward_backward_pipelining_with_interleaving", "interleaved_warmup_microbatches"]


def interleaved_warmup_microbatches(
    num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int, forward_only: bool = False
) -> int:
    """Forwards stage ``pp_rank`` runs before its first backward (NOTE [ Interleaved 1F1B ], 2)."""
    total = num_microbatches * vp_size
    if forward_only or num_microbatches == pp_size:
        return total
    return min((pp_size - pp_rank - 1) * 2 + (vp_size - 1) * pp_size, total)


def _check_chunks(model, data_iterator, num_microbatches: int, pp_size: int) -> None:
    if not isinstance(model, (list, tuple)) or not model:
        raise MegatronCoreError(
            "interleaved schedule: model must be a non-empty list of model chunks (one per "
            f"virtual stage), got {type(model).__name__}"
        )
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != len(model):
        got = len(data_iterator) if isinstance(data_iterator, (list, tuple)) else "not a list"
        raise MegatronCoreError(
            f"interleaved schedule: data_iterator must be a list with one iterator per model "
            f"chunk ({len(model)}), got {got}"
        )
    if isinstance(num_microbatches, int) and num_microbatches % pp_size:
        raise MegatronCoreError(
            f"interleaved schedule: num_microbatches ({num_microbatches}) must be divisible by "
            f"the pipeline size ({pp_size})"
        )


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
):
    """Interleaved 1F1B (NOTE [ Interleaved 1F1B ]) over ``len(model)`` chunks per stage.

    ``model`` and ``data_iterator`` are lists, one entry per chunk (vp_stage 0, 1, ...). Every
    exchange carries [s, b, h] activations or gradients (``s / tp`` under SP).

    Returns:
        on the last stage, ``loss_func``'s dicts (one per microbatch); else [].

    Raises:
        MegatronCoreError: before any communication, for num_microbatches not divisible by pp,
            model / data_iterator not lists of equal length, or the checks every schedule makes.
    """
    tp_size, cp_size = parallel_sizes(pg_collection)
    p2p = communicator(p2p_communicator, pg_collection, None)
    pp = p2p.pp_size
    _check_chunks(model, data_iterator, num_microbatches, pp)
    config = get_model_config(model[0])
    p2p.config = config if p2p.config is None else p2p.config
    check_schedule_args(
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        config=config,
        pp_size=pp,
        tp_size=tp_size,
    )
    group = option(config, "microbatch_group_size_per_vp_stage")
    if group is not None and group != pp:
        raise MegatronCoreError(
            f"interleaved schedule: microbatch_group_size_per_vp_stage ({group}) other than the "
            f"pipeline size ({pp}) is not supported"
        )
    if adjust_tensor_shapes_fn is not None:
        raise MegatronCoreError("interleaved schedule: adjust_tensor_shapes_fn is not supported")
    run = _Interleaved(
        forward_step_func,
        data_iterator,
        list(model),
        num_microbatches,
        config,
        p2p,
        get_tensor_shapes(
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            config=config,
            tp_size=tp_size,
            cp_size=cp_size,
        )[0],
        cp_size,
        forward_only,
        collect_non_loss_data,
    )
    run.warmup_and_steady()
    if not forward_only:
        run.cooldown()
    finalize(config, list(model), run.total_tokens, forward_only)
    return run.store


class _Interleaved:
    """The state of one interleaved pass: per-chunk queues of inputs, outputs, output grads."""

    def __init__(self, step_func, data, model, m, config, p2p, shape, cp_size, fwd_only, collect):
        self.step_func, self.data, self.model, self.m = step_func, data, model, m
        self.config, self.p2p, self.shape, self.cp_size = config, p2p, shape, cp_size
        self.forward_only, self.collect = fwd_only, collect
        self.vp = len(model)
        self.pp, self.rank = p2p.pp_size, p2p.pp_rank
        self.first, self.last = p2p.is_pp_first_stage, p2p.is_pp_last_stage
        self.total = m * self.vp
        self.all_warmup = m == self.pp
        self.warmup = interleaved_warmup_microbatches(m, self.pp, self.rank, self.vp, fwd_only)
        self.inputs = [[] for _ in model]
        self.outputs = [[] for _ in model]
        self.output_grads = [[] for _ in model]
        self.store: list = []
        self.total_tokens = torch.tensor(0, dtype=torch.int)
        self.deallocate = option(config, "deallocate_pipeline_outputs", False)

    def chunk(self, k: int, forward: bool) -> int:
        """Model chunk of virtual id k (NOTE [ Interleaved 1F1B ], rule 1)."""
        c = (k % (self.pp * self.vp)) // self.pp
        return c if forward else self.vp - 1 - c

    def microbatch(self, k: int) -> int:
        return (k // (self.pp * self.vp)) * self.pp + k % self.pp

    def forward(self, k: int) -> torch.Tensor | None:
        """Forward of virtual id k; returns what to send (None for the model's final chunk)."""
        c = self.chunk(k, True)
        if self.first and c == 0 and len(self.inputs[c]) == len(self.outputs[c]):
            self.inputs[c].append(None)
        is_last = self.last and c == self.vp - 1
        output, tokens = forward_step(
            self.step_func,
            self.data[c],
            self.model[c],
            self.m,
            self.inputs[c][-1],
            self.store,
            self.config,
            self.cp_size,
            self.collect,
            is_first_microbatch=self.microbatch(k) == 0,
            current_microbatch=self.microbatch(k),
            vp_stage=c,
            is_last_stage=is_last,
        )
        self.total_tokens += tokens
        self.outputs[c].append(output)
        if self.forward_only:
            self.inputs[c].pop()
            self.outputs[c].pop()
        return None if is_last else output

    def backward(self, k: int) -> torch.Tensor | None:
        """Backward of virtual id k; returns what to send (None for the model's first chunk)."""
        c = self.chunk(k, False)
        if self.last and c == self.vp - 1 and not self.output_grads[c]:
            self.output_grads[c].append(None)
        input_tensor = self.inputs[c].pop(0)
        grad = backward_step(
            input_tensor, self.outputs[c].pop(0), self.output_grads[c].pop(0), self.config
        )
        return None if (self.first and c == 0) else grad

    def _sent(self, output) -> None:
        deallocate_output_tensor(output, self.deallocate and not self.forward_only)

    def warmup_and_steady(self) -> None:
        p2p, shape, vp = self.p2p, self.shape, self.vp
        self.inputs[0].append(p2p.recv_forward(shape, self.first))
        for k in range(self.warmup):
            output = self.forward(k)
            next_c = self.chunk(k + 1, True)
            recv_prev = not (self.first and next_c == 0) and k != self.total - 1
            if k == self.warmup - 1 and not self.forward_only and not self.all_warmup:
                received, grad = p2p.send_forward_backward_recv_forward_backward(
                    output, None, recv_prev, not self.last, shape
                )
                self.output_grads[vp - 1].append(grad)
            else:
                received = p2p.send_forward_recv_forward(output, recv_prev, shape)
            self._sent(output)
            self.inputs[next_c].append(received)
        remaining = self.total - self.warmup
        for k in range(remaining):
            fk, bk = k + self.warmup, k
            output = self.forward(fk)
            input_grad = self.backward(bk)
            recv_prev, next_fc = self._next_forward(fk)
            recv_next, next_bc = self._next_backward(bk)
            if k == remaining - 1:
                recv_prev = False
            received, grad = p2p.send_forward_backward_recv_forward_backward(
                output, input_grad, recv_prev, recv_next, shape
            )
            self._sent(output)
            if recv_prev:
                self.inputs[next_fc].append(received)
            if recv_next:
                self.output_grads[next_bc].append(grad)

    def _next_forward(self, fk: int) -> tuple[bool, int]:
        """(receive an input?, for which chunk) after forward fk (NOTE [ Interleaved 1F1B ], 3)."""
        if not self.first:
            return True, self.chunk(fk + 1, True)
        c = self.chunk(fk - (self.pp - 1), True)
        return c != self.vp - 1, c + 1

    def _next_backward(self, bk: int) -> tuple[bool, int]:
        """(receive an output grad?, for which chunk) after backward bk."""
        if not self.last:
            return True, self.chunk(bk + 1, False)
        c = self.chunk(bk - (self.pp - 1), False)
        return c != 0, c - 1

    def cooldown(self) -> None:
        p2p, shape, vp = self.p2p, self.shape, self.vp
        if self.all_warmup:
            self.output_grads[vp - 1].append(p2p.recv_backward(shape, self.last))
        for k in range(self.total - self.warmup, self.total):
            input_grad = self.backward(k)
            next_c = self.chunk(k + 1, False)
            recv_next = not (self.last and next_c == vp - 1) and k != self.total - 1
            grad = p2p.send_backward_recv_backward(input_grad, recv_next, shape)
            self.output_grads[next_c].append(grad)
