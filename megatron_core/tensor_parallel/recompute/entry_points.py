"""Activation checkpointing: megatron-core's ``checkpoint`` and its variants.

``checkpoint(function, distribute_saved_activations, *args)`` is megatron-core's call and
semantics (the reentrant mode). Keyword arguments add what no peer combines: the non-reentrant
mode (torch.autograd.grad, kwargs, nested structures, nesting) with distributed saved inputs,
CPU offload of the saved inputs, and a determinism check of the recompute.
:class:`CheckpointWithoutOutput` and :func:`checkpoint_layer_stack` cover megatron-core's other
recompute entry points. Also re-exported by ``tensor_parallel.random``, as in megatron-core.

Files: this one (entry points, reentrant mode), saved_inputs.py (what is kept, RNG and
autocast replay, checksums), nonreentrant.py, without_output.py.

# NOTE [ Checkpoint rules ]
1. What is saved. Between forward and backward a checkpoint keeps its inputs, the forward's RNG
   snapshot, autocast state and torch-function modes, and nothing of the region's activations.
   An input is kept as given (an in-place change before backward raises), or as a separate copy
   when distributed or offloaded. The caller's tensors are never modified: megatron-core
   replaces ``args[0].data`` by the chunk, DeepSpeed leaves the caller's input as a 0-d tensor;
   here the chunk is a new tensor.
2. RNG replay order. Forward: snapshot the CPU generator, the device generator and every tracker
   stream, then run the function without grad (reentrant) or with saved-tensor hooks
   (non-reentrant). Backward: rebuild the inputs (rules 3, 4) -> snapshot the states current now
   -> set the forward's snapshot and autocast state, and enter each torch-function mode of the
   forward that is not active now -> recompute with grad -> restore the states from before the
   recompute (also when it raises) -> backpropagate. Dropout inside and outside
   ``get_cuda_rng_tracker().fork()`` draws the same masks twice, and what is drawn after backward
   is what would be drawn without checkpointing.
3. Distribution (``distribute_saved_activations=True``). A distributed input is kept as this
   rank's 1-D chunk of ceil(numel / tp) elements (``split_tensor_into_1d_equal_chunks``, the last
   chunk zero-padded) and all-gathered to its shape before the recompute, so every rank of the TP
   group must backpropagate through the checkpoint. ``distribute="first"`` (megatron) splits
   ``args[0]``, which must be a tensor; ``"all"`` splits every floating-point tensor input of at
   least tp elements; ``"every"`` every one, however small (as DeepSpeed partitions).
   Needs the TP group: parallel_state initialized, or ``tp_group=``. A
   distributed input must be equal on every rank of the TP group (replicated, as the hidden states
   between transformer layers are): the gather assembles it from every rank's chunk. Forward
   agrees its shape, dtype and a checksum across the TP group (check mode, and the default
   window of megatron_core.consistency): an input that differs raises on every rank, naming the
   checkpoint's input. With ``check_determinism`` the gathered input is compared with this
   rank's forward input. Over a one-rank TP group nothing is split: the input is kept as given
   (its one chunk would be a full copy, 2x the input's memory where the caller still holds it).
   One input's split, offload and rebuild are ``keep_tensor`` / ``rebuild_tensor`` in
   saved_inputs.py; deepspeed_checkpointing keeps its partitions with them too, choosing the
   inputs by DeepSpeed's rules (NOTE [ DeepSpeed checkpointing ]).
4. Offload (``offload_to_cpu=True``). Every kept input (its chunk when distributed: split first)
   is copied to the CPU in forward and back to its device before the gather in backward.
5. Non-reentrant (``use_reentrant=False``). The function runs once with grad, under
   ``saved_tensors_hooks`` whose pack keeps a small holder instead of each saved tensor. The
   first unpack of a backward recomputes the region (rule 2) until every saved tensor is back;
   each recomputed tensor is freed after its use, and another backward recomputes again. An
   unpack during the region's own forward (``torch.autograd.grad`` inside it) reads the forward's
   tensor. The recompute must save the forward's tensors, same count, shapes and dtypes, else
   MegatronCoreError. A checkpoint nested in another keeps its inputs through the outer one's
   hooks, so the outer region's memory is still freed. Details: NOTE [ Non-reentrant
   recompute ] in nonreentrant.py. The reentrant mode instead calls
   ``torch.autograd.backward`` inside backward: it refuses ``torch.autograd.grad``, takes only
   positional inputs, and gives no gradient to parameters when no input requires grad (it
   warns, as torch does).
6. Determinism check (``check_determinism=True``, off by default). Forward records a checksum
   (float64 sum, position-weighted sum, sum of ``|x|``) of every saved tensor (non-reentrant) and of
   every output (both modes); the recompute compares them and raises MegatronCoreError naming
   the first tensor that differs by more than 1e-6 of its sum of ``|x|``. It catches randomness the
   snapshot of rule 2 does not replay (a private torch.Generator) and non-deterministic ops.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.nonreentrant import (
    checkpoint_without_reentrant,
    set_checkpoint_early_stop,
)
from megatron_core.tensor_parallel.recompute.saved_inputs import (
    CheckpointOptions,
    Distribute,
    ForwardState,
    SavedInputs,
    alias_outer_outputs,
    backward_through,
    capture_saved_inputs,
    check_outputs,
    checkpointing_region,
    is_checkpointing,
    output_fingerprints,
)

__all__ = [
    "checkpoint",
    "CheckpointFunction",
    "Distribute",
    "capture_saved_inputs",
    "is_checkpointing",
    "set_checkpoint_early_stop",
]


class CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint (megatron-core's class; NOTE [ Checkpoint rules ], rules 1-4, 6).

    Forward: snapshot the RNG, run ``run_function(*args)`` without grad, keep the inputs (whole,
    as chunks, or offloaded). Backward: rebuild the inputs, replay the RNG, recompute with grad,
    restore the RNG, backpropagate through the recomputed outputs, return the input gradients.
    Called as ``CheckpointFunction.apply(run_function, distribute_saved_activations, *args)``,
    where the second argument is megatron-core's bool or a CheckpointOptions.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        """Snapshot the RNG, run ``run_function(*args)`` without grad, keep the inputs."""
        options = distribute_saved_activations
        if not isinstance(options, CheckpointOptions):
            options = _options(bool(options), args, Distribute.FIRST, False, False, None)
        ctx.run_function = run_function
        ctx.state = ForwardState.capture()  # rule 2
        with torch.no_grad(), checkpointing_region():
            outputs = alias_outer_outputs(run_function(*args))
        ctx.saved = SavedInputs(args, options, version_check=False)  # rules 1, 3, 4
        ctx.save_for_backward(*ctx.saved.tensors)
        ctx.saved.tensors = None  # autograd holds them now; read back through ctx
        ctx.saved.kept = _saved_tensors_of(ctx)
        ctx.fingerprints = output_fingerprints(outputs) if options.check_determinism else None
        return outputs

    @staticmethod
    def backward(ctx, *args):  # megatron-core's name: the output gradients
        """Rebuild the inputs, recompute under the forward's RNG, return the input gradients.

        Raises:
            MegatronCoreError: called through ``torch.autograd.grad`` (rule 5), or the recompute
                differs from the forward with check_determinism (rule 6).
        """
        if not torch.autograd._is_checkpoint_valid():  # rule 5
            raise MegatronCoreError(
                "checkpoint (reentrant) does not support torch.autograd.grad: call .backward(), "
                "or use checkpoint(..., use_reentrant=False) (NOTE [ Checkpoint rules ], rule 5)"
            )
        inputs = ctx.saved.rebuild(ctx.saved_tensors)
        with ctx.state.replayed(), torch.enable_grad(), checkpointing_region():  # rule 2
            outputs = ctx.run_function(*inputs)
        if ctx.fingerprints is not None:
            check_outputs(ctx.fingerprints, outputs)  # rule 6
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return (None, None, *backward_through(outputs, args, inputs))


def _saved_tensors_of(ctx) -> Callable[[], Sequence[torch.Tensor]]:
    """Reads ctx.saved_tensors through a weak reference (for SavedInputs.nbytes)."""
    ref = weakref.ref(ctx)
    return lambda: ref().saved_tensors if ref() is not None else ()


def _options(distribute_saved_activations, args, distribute, offload, check, tp_group):
    """Validate a call's settings (before anything runs) into CheckpointOptions."""
    if distribute_saved_activations is None:  # megatron-core 0.16 callers pass None for False
        distribute_saved_activations = False
    if not isinstance(distribute_saved_activations, bool):
        got = type(distribute_saved_activations).__name__
        raise MegatronCoreError(
            f"checkpoint: distribute_saved_activations (a {got}) must be a bool; the call is "
            "checkpoint(function, distribute_saved_activations, *args)"
        )
    try:
        distribute = Distribute(distribute)
    except ValueError:
        raise MegatronCoreError(
            f"checkpoint: distribute ({distribute!r}) must be one of "
            f"{[d.value for d in Distribute]}"
        ) from None
    for name, value in (("offload_to_cpu", offload), ("check_determinism", check)):
        if not isinstance(value, bool):
            raise MegatronCoreError(f"checkpoint: {name} ({value!r}) must be a bool")
    if not distribute_saved_activations:
        return CheckpointOptions(None, offload, check, tp_group)
    if distribute is Distribute.FIRST and not (args and torch.is_tensor(args[0])):
        first = type(args[0]).__name__ if args else "nothing"
        raise MegatronCoreError(
            f"checkpoint(distribute_saved_activations=True) splits args[0], which must be a "
            f"tensor (got {first}); pass distribute='all' to split every floating-point tensor "
            "(NOTE [ Checkpoint rules ], rule 3)"
        )
    if tp_group is None and not parallel_state.model_parallel_is_initialized():
        raise MegatronCoreError(
            "checkpoint(distribute_saved_activations=True) needs the tensor-parallel group, but "
            "parallel_state is not initialized: call parallel_state.initialize_model_parallel(...) "
            "first or pass tp_group= (NOTE [ Checkpoint rules ], rule 3)"
        )
    return CheckpointOptions(distribute, offload, check, tp_group)


def checkpoint(
    function: Callable[..., Any],
    distribute_saved_activations: bool | None,
    *args: Any,
    use_reentrant: bool = True,
    distribute: Distribute | str = Distribute.FIRST,
    offload_to_cpu: bool = False,
    check_determinism: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute it in backward.

    megatron-core's ``checkpoint(function, distribute_saved_activations, *args)`` with its
    defaults; see NOTE [ Checkpoint rules ] in this file for every rule cited below, and
    NOTE [ Non-reentrant recompute ] in nonreentrant.py for the non-reentrant mode.

    Args:
        function: the region to recompute; returns a tensor or a tuple. Inside it, draw randomness
            from the default generators or ``get_cuda_rng_tracker().fork()`` (rule 2).
        distribute_saved_activations: keep inputs as this rank's 1-D chunk (rule 3); None means
            False (megatron-core 0.16).
        *args: the function's positional arguments; non-tensors pass through.
        use_reentrant: True (megatron-core's mode) or False for the saved-tensor-hooks mode
            (rule 5), which also accepts ``**kwargs`` and tensors inside lists, tuples and dicts,
            ``torch.autograd.grad`` outside and inside the function, and the three options below.
        distribute: with distribute_saved_activations, which inputs to split: "first"
            (megatron-core: args[0]), "all" (every floating-point tensor of >= tp elements) or
            "every" (every floating-point tensor, padded when smaller than tp).
        offload_to_cpu: keep the saved inputs (or their chunks) on the CPU (rule 4).
        check_determinism: verify that the recompute reproduces the forward's values (rule 6).
        tp_group: group to distribute over; default parallel_state's tensor-parallel group.
        context_fn: non-reentrant only: returns (forward context, recompute context), as for
            torch.utils.checkpoint; ``create_selective_checkpoint_contexts(policy)`` saves the
            ops the policy names and recomputes the rest.
        debug: non-reentrant only: record the ops of forward and recompute; a recompute that
            differs raises with the first differing op and its shapes.
        early_stop: non-reentrant only: stop the recompute once every saved tensor is back
            (overridden by ``set_checkpoint_early_stop``).
        **kwargs: keyword arguments of ``function`` (non-reentrant mode only). Names above are
            this function's own and cannot be passed through.

    Returns:
        What ``function`` returns.

    Raises:
        MegatronCoreError: an invalid setting (raised before anything runs); in backward,
            ``torch.autograd.grad`` through the reentrant mode, no recomputed output requiring
            grad (reentrant), an input modified in place, or a recompute that differs from the
            forward (rules 5, 6).
    """
    options = _options(
        distribute_saved_activations,
        args,
        distribute,
        offload_to_cpu,
        check_determinism,
        tp_group,
    )
    if not isinstance(use_reentrant, bool):
        raise MegatronCoreError(f"checkpoint: use_reentrant ({use_reentrant!r}) must be a bool")
    for name, value in (("debug", debug), ("early_stop", early_stop)):
        if not isinstance(value, bool):
            raise MegatronCoreError(f"checkpoint: {name} ({value!r}) must be a bool")
    if context_fn is not None and not callable(context_fn):
        raise MegatronCoreError(f"checkpoint: context_fn ({context_fn!r}) must be callable")
    if not use_reentrant:
        return checkpoint_without_reentrant(
            function, options, args, kwargs, context_fn, debug, early_stop
        )
    if kwargs:
        raise MegatronCoreError(
            f"checkpoint: keyword arguments {sorted(kwargs)} for the function need "
            "use_reentrant=False (the reentrant mode takes positional inputs only)"
        )
    if context_fn is not None or debug:
        raise MegatronCoreError(
            "checkpoint: context_fn and debug=True need use_reentrant=False (the reentrant mode "
            "recomputes inside backward with its own autograd call)"
        )
    if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad for a in args):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None (the reentrant "
            "checkpoint runs the function without grad, so its parameters get no gradient "
            "either): make an input require grad, or use checkpoint(..., use_reentrant=False)",
            stacklevel=2,
        )
    return CheckpointFunction.apply(function, options, *args)
