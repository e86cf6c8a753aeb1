"""One pass of the interleaved schedule (NOTE [ Interleaved 1F1B ] in interleaved.py).

Forward k and backward k are "virtual ids" into the stage's schedule table; the per-chunk queues
hold received inputs, outputs awaiting their backward, and received output gradients. With
``overlap_p2p_comm`` a receive's buffer is queued at once and its handle waited for just before
the compute that reads it (rule 4).
"""

from __future__ import annotations

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel._args import option
from megatron_core.pipeline_parallel._plan import get_schedule_table, pp_rank_microbatches
from megatron_core.pipeline_parallel._steps import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)

__all__ = ["InterleavedRun"]


def _per_chunk(config, name: str, vp: int):
    """``config.<name>`` as one function per chunk (megatron-core accepts one or a list)."""
    func = option(config, name)
    if func is None or isinstance(func, list):
        return func
    return [func] * vp


class InterleavedRun:
    """The state of one interleaved pass over ``len(model)`` chunks on this stage."""

    def __init__(self, step_func, data, model, m, config, p2p):
        self.step_func, self.data, self.model, self.m = step_func, data, model, m
        self.config, self.p2p = config, p2p
        self.vp, self.pp, self.rank = len(model), p2p.pp_size, p2p.pp_rank
        self.first, self.last = p2p.is_pp_first_stage, p2p.is_pp_last_stage
        self.store: list = []
        self.total_tokens = torch.tensor(0, dtype=torch.int)
        self.recv_prev_handles: list = []
        self.recv_next_handles: list = []
        self.send_handles: dict = {"send_next": None, "send_prev": None}
        self._sync = None

    def setup(self, shape, group, cp_size, forward_only, collect, first_val_step) -> None:
        """Plan the pass: table, warm-up count, options (NOTE [ Interleaved 1F1B ], 1-2)."""
        self.shape, self.cp_size, self.collect = shape, cp_size, collect
        self.forward_only, self.first_val_step = forward_only, first_val_step
        self.mb_table, self.chunk_table = zip(*get_schedule_table(self.m, self.vp, group))
        self.total, self.all_warmup, self.warmup, self.remaining = pp_rank_microbatches(
            self.m, self.vp, group, self.pp, self.rank, self.vp, forward_only
        )
        self.overlap = bool(option(self.config, "overlap_p2p_comm", False))
        self.flush = self.overlap and bool(option(self.config, "overlap_p2p_comm_warmup_flush"))
        self.deallocate = bool(option(self.config, "deallocate_pipeline_outputs", False))
        self.grad_sync = (
            None if forward_only else _per_chunk(self.config, "grad_sync_func", self.vp)
        )
        self.param_sync = (
            None if forward_only else _per_chunk(self.config, "param_sync_func", self.vp)
        )
        self.synchronized: set[int] = set()
        self.inputs = [[] for _ in self.model]
        self.outputs = [[] for _ in self.model]
        self.output_grads = [[] for _ in self.model]

    # --- the plan ---------------------------------------------------------------------------

    def chunk(self, k: int, forward: bool) -> int:
        """Model chunk of virtual id k (backwards run the chunks mirrored)."""
        c = self.chunk_table[k % self.total]
        return c if forward else self.vp - 1 - c

    def released(self, k: int, c: int) -> int:
        """Inputs of chunk c already dropped from its queue before forward k."""
        if self.forward_only:
            return self.chunk_table[:k].count(c)
        if k < self.warmup:
            return 0
        return self.chunk_table[: k - self.warmup].count(self.vp - 1 - c)

    def recv_plan(self, k: int, forward: bool) -> tuple[bool, int]:
        """(receive after step k?, into which chunk's queue) (NOTE [ Interleaved 1F1B ], 3)."""
        leading = self.first if forward else self.last
        if not leading:
            return True, self.chunk(k + 1, forward)
        recv = k >= self.pp - 1
        c = self.chunk(k - (self.pp - 1) if recv else k + 1, forward)
        if c == (self.vp - 1 if forward else 0):
            recv = False
        return recv, c + 1 if forward else c - 1

    def model_input_edge(self, c: int) -> bool:
        return self.first and c == 0

    def model_output_edge(self, c: int) -> bool:
        return self.last and c == self.vp - 1

    # --- compute ------------------------------------------------------------------------------

    def forward(self, k: int):
        """Forward of virtual id k; returns what to send on (None for the model's last chunk)."""
        c, mb = self.chunk(k, True), self.mb_table[k]
        self.sync_params_ahead(k)
        if self.model_input_edge(c) and len(self.inputs[c]) == len(self.outputs[c]):
            self.inputs[c].append(None)
        input_tensor = self.inputs[c][mb - self.released(k, c)]
        output, tokens = forward_step(
            self.step_func,
            self.data[c],
            self.model[c],
            self.m,
            input_tensor,
            self.store,
            self.config,
            self.cp_size,
            self.collect,
            is_first_microbatch=check_first_val_step(
                self.first_val_step, self.forward_only, mb == 0
            ),
            current_microbatch=mb,
            vp_stage=c,
            is_last_stage=self.model_output_edge(c),
        )
        self.total_tokens += tokens
        self.outputs[c].append(output)
        if self.forward_only:
            self.inputs[c].pop(0)
            self.outputs[c].pop()
        return None if self.model_output_edge(c) else output

    def backward(self, k: int):
        """Backward of virtual id k; returns what to send back (None for the model's first
        chunk). Grad sync runs only in the backward of a chunk's last microbatch."""
        c = self.chunk(k, False)
        if self.grad_sync is None and self.last_of_chunk(k):
            self.enable_sync()
            self.synchronized.add(c)
        if self.model_output_edge(c) and not self.output_grads[c]:
            self.output_grads[c].append(None)
        input_tensor, output = self.inputs[c].pop(0), self.outputs[c].pop(0)
        grad = backward_step(input_tensor, output, self.output_grads[c].pop(0), None, self.config)
        self.sync_grads_behind(k)
        self.disable_sync()
        return None if self.model_input_edge(c) else grad

    def last_of_chunk(self, k: int) -> bool:
        return 0 <= k < self.total and self.mb_table[k] == self.m - 1

    def sync_params_ahead(self, k: int) -> None:
        """megatron-core's ``param_sync_func`` timing: stage r starts chunk c + 1's parameter
        sync at forward k when forward k + r is chunk c's first microbatch (chunks 0 and 1
        are synced before the pass), so all stages launch it at about the same time."""
        ahead = k + self.rank
        if self.param_sync is None or ahead >= self.total or self.mb_table[ahead] != 0:
            return
        c = self.chunk(ahead, True) + 1
        if 1 < c < self.vp:
            self.param_sync[c](self.model[c].parameters())

    def sync_grads_behind(self, k: int) -> None:
        """megatron-core's ``grad_sync_func`` timing: after backward k, stage r launches the
        grad sync of the chunk whose last microbatch was backward k - r."""
        behind = k - self.rank
        if self.grad_sync is None or not self.last_of_chunk(behind):
            return
        c = self.chunk(behind, False)
        self.enable_sync()
        self.grad_sync[c](self.model[c].parameters())
        self.synchronized.add(c)

    def sync_remaining_grads(self) -> None:
        """After the cool-down: every chunk whose grad sync has not been launched yet."""
        self.enable_sync()
        for c in range(self.vp) if self.grad_sync is not None else ():
            if c not in self.synchronized:
                self.grad_sync[c](self.model[c].parameters())
                self.synchronized.add(c)

    def enable_sync(self) -> None:
        if self._sync is not None:
            self._sync.__exit__(None, None, None)
            self._sync = None

    def disable_sync(self) -> None:
        if self._sync is None:
            self._sync = self._no_sync()
            self._sync.__enter__()

    # --- communication (NOTE [ Interleaved 1F1B ], rule 4) ------------------------------------

    def register(self, handles, send_name: str | None) -> None:
        """Wait for the previous send in this direction and keep this one's (``send_name``
        None: a receive posted alone); queue the receive's handle."""
        if send_name is not None:
            previous = self.send_handles[send_name]
            if previous is not None:
                previous.wait()
            self.send_handles[send_name] = handles.pop(send_name, None)
        if "recv_prev" in handles:
            self.recv_prev_handles.append(handles.pop("recv_prev"))
        if "recv_next" in handles:
            self.recv_next_handles.append(handles.pop("recv_next"))

    def wait_input(self, c: int, forward: bool) -> None:
        """Wait for the oldest pending receive feeding this step (none at the model's edge)."""
        edge = self.model_input_edge(c) if forward else self.model_output_edge(c)
        pending = self.recv_prev_handles if forward else self.recv_next_handles
        if not edge and pending:
            pending.pop(0).wait()

    def post_forward(self, output, recv: bool, c_next: int) -> None:
        """Post the forward send / receive of one step without waiting."""
        received, handles = self.p2p.send_forward_recv_forward(output, recv, self.shape, True)
        self.register(handles, "send_next")
        deallocate_output_tensor(output, self.deallocate)
        if recv:
            self.inputs[c_next].append(received)

    def post_backward(self, grad, recv: bool, c_next: int) -> None:
        """Post the backward send / receive of one step without waiting."""
        received, handles = self.p2p.send_backward_recv_backward(grad, recv, self.shape, True)
        self.register(handles, "send_prev")
        if recv:
            self.output_grads[c_next].append(received)

    # --- the phases ---------------------------------------------------------------------------

    def execute(self, no_sync) -> None:
        """Warm-up, steady 1F1B, cool-down; then check that no receive is left pending."""
        self._no_sync = no_sync
        self.disable_sync()
        if self.param_sync is not None:
            for c in range(min(2, self.vp)):
                self.param_sync[c](self.model[c].parameters())
        try:
            self.inputs[0].append(self.p2p.recv_forward(self.shape, self.first))
            for k in range(self.warmup):
                self.warmup_step(k)
            for k in range(self.remaining):
                self.steady_step(k)
            if not self.forward_only:
                self.cooldown()
            self.wait_sends()
        finally:
            self.enable_sync()
        if self.recv_prev_handles or self.recv_next_handles:
            raise MegatronCoreError(
                f"interleaved schedule: {len(self.recv_prev_handles)} forward and "
                f"{len(self.recv_next_handles)} backward receives left pending at the end"
            )

    def warmup_step(self, k: int) -> None:
        """Forward k of the warm-up, then its exchange (and, at the last one, the first
        receive of an output gradient)."""
        c = self.chunk(k, True)
        if self.flush and k != 0:
            self.wait_input(c, True)
        recv, c_next = self.recv_plan(k, True)
        recv = recv and k != self.total - 1
        prefetched = None
        if self.flush and not self.first:  # receive for k + 1 posted before computing k
            prefetched, handles = self.p2p.send_forward_recv_forward(None, recv, self.shape, True)
            self.register(handles, None)
        output = self.forward(k)
        turn = k == self.warmup - 1 and not self.forward_only and not self.all_warmup
        if self.flush:
            self.post_forward(output, recv and self.first, c_next)
            if recv and not self.first:
                self.inputs[c_next].append(prefetched)
        elif turn and not self.overlap:
            received, grad = self.p2p.send_forward_backward_recv_forward_backward(
                output, None, recv, not self.last, self.shape
            )
            self._after_blocking_forward(output, recv, received, c_next)
            self.output_grads[self.vp - 1].append(grad)
        else:
            received = self.p2p.send_forward_recv_forward(output, recv, self.shape)
            self._after_blocking_forward(output, recv, received, c_next)
        if turn and self.overlap:
            self.post_backward(None, not self.last, self.vp - 1)

    def _after_blocking_forward(self, output, recv: bool, received, c_next: int) -> None:
        deallocate_output_tensor(output, self.deallocate)
        if recv:
            self.inputs[c_next].append(received)

    def steady_step(self, k: int) -> None:
        """One forward (virtual id warmup + k) and one backward (virtual id k)."""
        fk, final = k + self.warmup, k == self.remaining - 1
        fc, bc = self.chunk(fk, True), self.chunk(k, False)
        recv_prev, fc_next = self.recv_plan(fk, True)
        recv_prev = recv_prev and not final
        recv_next, bc_next = self.recv_plan(k, False)
        if self.overlap:
            self.wait_input(fc, True)
            self.post_forward(self.forward(fk), recv_prev, fc_next)
            self.wait_input(bc, False)
            self.post_backward(self.backward(k), recv_next, bc_next)
            return
        output, grad = self.forward(fk), self.backward(k)
        received, received_grad = self.p2p.send_forward_backward_recv_forward_backward(
            output, grad, recv_prev, recv_next, self.shape
        )
        self._after_blocking_forward(output, recv_prev, received, fc_next)
        if recv_next:
            self.output_grads[bc_next].append(received_grad)

    def cooldown(self) -> None:
        """The remaining backwards (flushing the pipeline); then wait for the last send."""
        if self.all_warmup:
            self.output_grads[self.vp - 1].append(self.p2p.recv_backward(self.shape, self.last))
        for k in range(self.remaining, self.total):
            self.cooldown_step(k)
        self.sync_remaining_grads()

    def wait_sends(self) -> None:
        """Wait for the last posted send in each direction (its buffer must outlive it)."""
        for name in ("send_next", "send_prev"):
            if self.send_handles[name] is not None:
                self.send_handles[name].wait()
                self.send_handles[name] = None

    def cooldown_step(self, k: int) -> None:
        c = self.chunk(k, False)
        if k != 0:
            self.wait_input(c, False)
        recv, c_next = self.recv_plan(k, False)
        recv = recv and k != self.total - 1
        prefetched = None
        if self.flush and not self.last:  # receive for k + 1 posted before computing k
            prefetched, handles = self.p2p.send_backward_recv_backward(None, recv, self.shape, True)
            self.register(handles, None)
        grad = self.backward(k)
        if self.flush:
            self.post_backward(grad, recv and self.last, c_next)
            if recv and not self.last:
                self.output_grads[c_next].append(prefetched)
        else:
            received = self.p2p.send_backward_recv_backward(grad, recv, self.shape)
            if recv:
                self.output_grads[c_next].append(received)
