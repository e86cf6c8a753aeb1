"""CheckpointWithoutOutput: recompute a region whose output storage was released (megatron-core).

A region's output is usually saved again by the op that consumes it (e.g. the activation output
by the next linear layer), so an ordinary checkpoint still keeps it. Here the output's storage is
released after the consumer ran and refilled by recomputation from a gradient hook, before the
consumer's backward reads it. RNG and autocast replay follow NOTE [ Checkpoint rules ], rule 2,
in entry_points.py.

Usage (megatron-core's MLP)::

    ckpt = CheckpointWithoutOutput()
    act = ckpt.checkpoint(activation_func, fc1_out)
    out = fc2(act)
    ckpt.discard_output_and_register_recompute(out)  # act's storage is freed here
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.saved_inputs import (
    ForwardState,
    alias_outer_outputs,
    backward_through,
)

__all__ = ["CheckpointWithoutOutput", "CheckpointWithoutOutputFunction"]


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """megatron-core's helper of :class:`CheckpointWithoutOutput`.

    Called as ``CheckpointWithoutOutputFunction.apply(run_function, owner, *args)``. Forward:
    run the function without grad, save the inputs, set ``owner.ctx``. Backward: backpropagate
    through ``ctx.outputs`` from ``ctx.inputs``, both set by the owner's recompute (which runs
    here first if no gradient hook ran it), then drop them.
    """

    @staticmethod
    def forward(ctx, run_function, checkpoint_without_output_obj, *args):
        """Run ``run_function(*args)`` without grad; save the inputs for the recompute."""
        with torch.no_grad():
            outputs = alias_outer_outputs(run_function(*args))
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.non_tensors = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[a.detach() for a in args if torch.is_tensor(a)])
        ctx.inputs_require_grad = [a.requires_grad for a in args if torch.is_tensor(a)]
        ctx.inputs = ctx.outputs = None  # set by the owner's _recompute
        checkpoint_without_output_obj.ctx = ctx
        ctx.owner = checkpoint_without_output_obj
        return outputs

    @staticmethod
    def backward(ctx, *args):
        """Backpropagate ``args`` (the output gradients) through the recomputed outputs; return
        the input gradients."""
        if ctx.outputs is None and ctx.owner is not None:
            ctx.owner._recompute(None)
        if ctx.outputs is None:
            raise MegatronCoreError(
                "CheckpointWithoutOutput: a second backward through the same checkpoint() call; "
                "the recompute runs once (retain_graph=True is not supported, as in megatron-core)"
            )
        inputs, outputs = ctx.inputs, ctx.outputs
        ctx.inputs = ctx.outputs = ctx.owner = None
        return (None, None, *backward_through(outputs, args, inputs))


_CheckpointWithoutOutputFunction = CheckpointWithoutOutputFunction  # the earlier private name


class CheckpointWithoutOutput:
    """Checkpoint a region and release its output until backward (megatron-core's API).

    One object serves one ``checkpoint`` call. After :meth:`discard_output_and_register_recompute`
    the outputs keep their shape and metadata but no storage; the gradient hook on ``hook_tensor``
    recomputes them and copies the values back into the same storage (the version counters that
    autograd checks are not bumped), so the consumer's saved reference reads the right values.

    Args:
        fp8: accepted for megatron-core compatibility; fp8 recompute is not supported here.
    """

    def __init__(self, fp8: bool = False):
        if fp8:
            raise MegatronCoreError("CheckpointWithoutOutput(fp8=True) is not supported")
        self.run_function: Callable[..., Any] | None = None
        self.ctx = None
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self._state: ForwardState | None = None
        self._nbytes: list[int] = []

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """Run ``run_function(*args)`` without keeping its activations; returns its outputs."""
        if self.run_function is not None:
            raise MegatronCoreError(
                "CheckpointWithoutOutput.checkpoint called twice: use one object per region"
            )
        self.run_function = run_function
        self._state = ForwardState.capture()
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Release the outputs' storage; recompute them when ``hook_tensor``'s gradient is ready.

        The caller makes sure the outputs are not read again in forward and that the gradient
        of ``hook_tensor`` is computed before the consumer's backward reads them (megatron-core's
        contract). If ``hook_tensor`` does not require grad, the region recomputes in its own
        backward instead and the outputs stay released until then.

        Raises:
            MegatronCoreError: called before checkpoint, or an output shares its storage with an
                input (releasing it would destroy the input).
        """
        if self.outputs is None or self.ctx is None:
            raise MegatronCoreError(
                "discard_output_and_register_recompute called before checkpoint(...)"
            )
        inputs = {t.untyped_storage().data_ptr() for t in self.ctx.saved_tensors}
        for i, out in enumerate(self.outputs):
            if torch.is_tensor(out) and out.untyped_storage().data_ptr() in inputs:
                raise MegatronCoreError(
                    f"CheckpointWithoutOutput: output #{i} shares storage with an input of the "
                    "region; releasing it would destroy the input"
                )
        self._nbytes = [
            o.untyped_storage().nbytes() if torch.is_tensor(o) else 0 for o in self.outputs
        ]
        for out in self.outputs:
            if torch.is_tensor(out):
                out.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad: torch.Tensor | None) -> None:
        """Gradient hook: recompute the region (rule 2) and refill the released outputs."""
        ctx = self.ctx
        if ctx is None or ctx.outputs is not None:
            return  # already done (a second hook call, or the backward got there first)
        if not torch.autograd._is_checkpoint_valid():
            raise MegatronCoreError(
                "CheckpointWithoutOutput does not support torch.autograd.grad: call .backward()"
            )
        saved = iter(zip(ctx.saved_tensors, ctx.inputs_require_grad))
        inputs = []
        for is_tensor, value in zip(ctx.is_tensor, ctx.non_tensors):
            if is_tensor:
                value, requires_grad = next(saved)
                value = value.detach().requires_grad_(requires_grad)
            inputs.append(value)
        with self._state.replayed(), torch.enable_grad():
            outputs = self.run_function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        with torch.no_grad():  # refill what discard released; _nbytes is empty if it never ran
            for old, new, nbytes in zip(self.outputs, outputs, self._nbytes):
                if torch.is_tensor(old) and nbytes:
                    old.untyped_storage().resize_(nbytes)
                    old.data.copy_(new)  # .data: a fresh version counter, autograd sees no change
        ctx.inputs, ctx.outputs = inputs, outputs
        self.ctx = self.outputs = self.run_function = self._state = None
