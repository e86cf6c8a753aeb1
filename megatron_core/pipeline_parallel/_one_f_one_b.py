"""One pass of the non-interleaved 1F1B schedule (NOTE [ 1F1B ] in schedules.py).

Tensors travel as megatron-core's lists (one entry per shape of ``get_tensor_shapes``), so an
``adjust_tensor_shapes_fn`` that returns several shapes works; the chunk receives the list.
"""

from __future__ import annotations

import torch

from megatron_core.pipeline_parallel._args import no_sync_context, option
from megatron_core.pipeline_parallel._steps import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)

__all__ = ["OneFOneB"]


class OneFOneB:
    """The state of one 1F1B pass on this stage."""

    def __init__(self, step_func, data, model, m, config, p2p):
        self.step_func, self.data, self.model, self.m = step_func, data, model, m
        self.config, self.p2p = config, p2p
        self.first, self.last = p2p.is_pp_first_stage, p2p.is_pp_last_stage
        self.store: list = []
        self.total_tokens = torch.tensor(0, dtype=torch.int)
        self.inputs: list = []
        self.outputs: list = []
        self.deallocate = bool(option(config, "deallocate_pipeline_outputs", False))
        self.grad_sync = option(config, "grad_sync_func")
        self._sync = None

    def forward(self, i: int, input_tensor, is_first: bool):
        output, tokens = forward_step(
            self.step_func,
            self.data,
            self.model,
            self.m,
            input_tensor,
            self.store,
            self.config,
            self.cp_size,
            self.collect,
            is_first_microbatch=check_first_val_step(
                self.first_val_step, self.forward_only, is_first
            ),
            current_microbatch=i,
            is_last_stage=self.last,
        )
        self.total_tokens += tokens
        return output

    def keep(self, input_tensor, output) -> None:
        """Hold a microbatch for its backward (NOTE [ Pipeline outputs ], rule 1)."""
        self.inputs.append(input_tensor)
        self.outputs.append(output)
        deallocate_output_tensor(output, self.deallocate)

    def backward(self, output_grad):
        input_tensor, output = self.inputs.pop(0), self.outputs.pop(0)
        return backward_step(input_tensor, output, output_grad, None, self.config)

    def enable_sync(self, last_backward: bool = False) -> None:
        """Leave ``no_sync_func``; at the last backward only on stage 0 when a
        ``grad_sync_func`` is set (megatron-core: the others sync in the bubble, at the end)."""
        if last_backward and self.grad_sync is not None and self.p2p.pp_rank != 0:
            return
        if self._sync is not None:
            self._sync.__exit__(None, None, None)
            self._sync = None

    def execute(self, recv, send, cp_size, forward_only, collect, first_val_step) -> None:
        """Warm-up, steady 1F1B and cool-down (NOTE [ 1F1B ], rules 1-3)."""
        self.cp_size, self.collect = cp_size, collect
        self.forward_only, self.first_val_step = forward_only, first_val_step
        self.recv, self.send = recv, send
        warmup = min(self.p2p.pp_size - self.p2p.pp_rank - 1, self.m)
        self._sync = no_sync_context(self.config)()
        self._sync.__enter__()
        try:
            for i in range(warmup):  # rule 1
                input_tensor = self.p2p.recv_forward(recv, self.first)
                output = self.forward(i, input_tensor, i == 0)
                self.p2p.send_forward(output, self.last)
                if not forward_only:
                    self.keep(input_tensor, output)
                output = input_tensor = None  # kept by keep() alone (NOTE [ Pipeline outputs ], 5)
            self.steady(warmup)
            if not forward_only:
                self.cooldown(warmup)
                if self._sync is not None:  # the grad reductions not launched yet
                    self.enable_sync()
                    if self.grad_sync is not None:
                        self.grad_sync(self.model.parameters())
        finally:
            self.enable_sync()

    def steady(self, warmup: int) -> None:
        """Rule 2: forward i + warmup, exchange with the next stage, backward i, exchange with
        the previous stage (which brings the next input)."""
        p2p, remaining = self.p2p, self.m - warmup
        input_tensor = p2p.recv_forward(self.recv, self.first) if remaining > 0 else None
        for k in range(remaining):
            final = k == remaining - 1
            output = self.forward(k + warmup, input_tensor, k == 0 and warmup == 0)
            if self.forward_only:
                p2p.send_forward(output, self.last)
                input_tensor = None if final else p2p.recv_forward(self.recv, self.first)
                continue
            output_grad = p2p.send_forward_recv_backward(output, self.send, self.last)
            self.keep(input_tensor, output)
            if final and warmup == 0:
                self.enable_sync(last_backward=True)
            input_grad = self.backward(output_grad)
            output = output_grad = None  # NOTE [ Pipeline outputs ], rule 5
            if final:
                input_tensor = None
                p2p.send_backward(input_grad, self.first)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_grad, self.recv, self.first)
            input_grad = None  # sent: not held through the next forward and backward (rule 5)

    def cooldown(self, warmup: int) -> None:
        """Rule 3: the remaining backwards; grad sync is on for the very last one."""
        for i in range(warmup):
            if i == warmup - 1:
                self.enable_sync(last_backward=True)
            output_grad = self.p2p.recv_backward(self.send, self.last)
            self.p2p.send_backward(self.backward(output_grad), self.first)
