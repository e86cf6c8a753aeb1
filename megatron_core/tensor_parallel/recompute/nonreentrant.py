"""Non-reentrant checkpoint: torch.autograd.graph.saved_tensors_hooks with distributed inputs.

``checkpoint(..., use_reentrant=False)`` lands here. See NOTE [ Checkpoint rules ] in
entry_points.py, rule 5 for the mechanism and NOTE [ Non-reentrant recompute ] below for how
one recompute is run; rules 1-4 and 6 apply unchanged.

# NOTE [ Non-reentrant recompute ]
1. Forward. The pack hook hands autograd a small holder per saved tensor and records the
   tensor's shape and dtype. While the region's own forward runs, the frame also keeps the
   saved tensors themselves: an unpack during the forward (``torch.autograd.grad`` inside the
   region, or a nested region doing so) returns the original tensor and recomputes nothing.
   They are dropped when the forward returns (also when it raises).
2. One recompute per backward. The first unpack in a backward (one autograd graph task)
   recomputes the region into a list indexed like the holders; each unpack hands out its
   tensor and drops it from the list, so a recomputed tensor is freed as soon as the node that
   needs it has run. A second backward (``retain_graph=True``) recomputes again, with the same
   RNG replay, so it reads the same values. An unpack outside any backward recomputes without
   keeping anything.
3. Early stop (on by default; ``early_stop=False`` or :func:`set_checkpoint_early_stop`). Once
   the recompute has saved as many tensors as the forward, the pack hook raises a private
   exception that the recompute catches: what the region computes after its last saved tensor
   (often a whole matmul) is never recomputed. Every state the function changed is restored as
   on any exit: the RNG states from before the recompute (rule 2 of NOTE [ Checkpoint rules ]),
   autocast, tracker forks (their ``finally``).
4. Checks. Each tensor the recompute saves must match the forward's shape and dtype (values too
   with ``check_determinism``); more or fewer tensors is an error. With ``debug=True`` both runs
   record their ops (``debug.py``) and the error shows the first op that differs.
5. Nesting. A region inside another keeps its inputs through the enclosing region's hooks
   (innermost pair on a thread-local stack), so they are recomputed with the outer region.
6. ``context_fn`` returns (forward context, recompute context), entered around the function in
   forward and in every recompute: torch's ``create_selective_checkpoint_contexts(policy)``
   works as with torch.utils.checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint  # a submodule torch < 2.7 does not import by itself
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from megatron_core import compat
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.debug import OpLog, first_difference
from megatron_core.tensor_parallel.recompute.saved_inputs import (
    CheckpointOptions,
    Fingerprint,
    ForwardState,
    SavedInputs,
    check_outputs,
    checkpointing_region,
    determinism_error,
    output_fingerprints,
    tensor_name,
)

__all__ = ["checkpoint_without_reentrant", "set_checkpoint_early_stop"]


class _Holder:
    """Stands in the autograd graph for one saved tensor: its position in the frame."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index


class _StopRecomputation(Exception):
    """Raised by a recompute's pack hook once every saved tensor is back (rule 3)."""


class _Mismatch(Exception):
    """A recompute that differs from the forward (rule 4); turned into MegatronCoreError."""


# The (pack, unpack) pairs of the non-reentrant checkpoints running in this thread, innermost
# last. An inner checkpoint keeps its inputs through the enclosing pair (rule 5).
_local = threading.local()


def _stack() -> list[tuple[Callable, Callable]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def _hooks(pack: Callable, unpack: Callable) -> Iterator[None]:
    stack = _stack()
    stack.append((pack, unpack))
    try:
        with saved_tensors_hooks(pack, unpack):
            yield
    finally:
        stack.pop()


def _identity(x: Any) -> Any:
    return x


_early_stop_override: bool | None = None


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Inside the block, non-reentrant checkpoints created there stop early (or not).

    Overrides the ``early_stop`` argument of :func:`checkpoint` as torch's context manager of the
    same name does for torch.utils.checkpoint (which is honoured too). See NOTE [ Non-reentrant
    recompute ], rule 3.
    """
    global _early_stop_override
    previous, _early_stop_override = _early_stop_override, bool(enable)
    try:
        yield
    finally:
        _early_stop_override = previous


def _resolve_early_stop(early_stop: bool) -> bool:
    if _early_stop_override is not None:
        return _early_stop_override
    torch_override = compat.checkpoint_early_stop_override()
    return early_stop if torch_override is None else torch_override


def _graph_task_id() -> Any:
    """The key of the backward running now (rule 2); None outside any backward."""
    group = compat.current_graph_exec_group()
    if group is not None:
        return group
    gid = compat.current_graph_task_id()
    return None if gid == -1 else gid


class _Frame:
    """One non-reentrant checkpoint call: inputs, forward state, what the forward saved."""

    def __init__(self, function, spec, saved: SavedInputs, options: CheckpointOptions, extra):
        self.function = function
        self.spec = spec
        self.saved = saved
        self.check = options.check_determinism
        self.early_stop, self.recompute_context, self.debug = extra
        self.state = ForwardState.capture()
        self.enclosing_unpack: Callable | None = None
        self.holders: list[weakref.ref[_Holder]] = []
        self.meta: list[tuple[torch.Size, torch.dtype]] = []
        self.fingerprints: list[Fingerprint] = []
        self.output_fingerprints: list[Fingerprint] = []
        self.forward_tensors: list[torch.Tensor] | None = []  # rule 1
        self.forward_log: OpLog | None = None
        self.recomputed: dict[Any, _Recompute] = {}  # graph task -> its recompute (rule 2)

    def keep_inputs_in(self, enclosing: tuple[Callable, Callable] | None) -> None:
        """Pass the kept inputs through the enclosing checkpoint's hooks when nested (rule 5)."""
        if enclosing is not None:
            pack, self.enclosing_unpack = enclosing
            self.saved.tensors = [pack(t) for t in self.saved.tensors]

    def pack(self, t: torch.Tensor) -> _Holder:
        """Forward: a holder for ``t``; ``t`` itself only until the forward returns (rule 1)."""
        holder = _Holder(len(self.meta))
        self.holders.append(weakref.ref(holder))
        self.meta.append((t.shape, t.dtype))
        self.forward_tensors.append(t)
        if self.check:
            name = f"saved tensor #{holder.index} ({tensor_name(t)})"
            with self.forward_log.mute() if self.debug else contextlib.nullcontext():
                self.fingerprints.append(Fingerprint.of(t, name, values=True))
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        """Backward: the recomputed tensor of ``holder`` (recomputing on first use, rule 2)."""
        if self.forward_tensors is not None:  # rule 1: inside the region's own forward
            return self.forward_tensors[holder.index]
        gid = _graph_task_id()
        run = self.recomputed.get(gid) if gid is not None else None
        if run is None:
            run = _Recompute(self)
            run.run()
            if gid is not None:
                self.recomputed[gid] = run
        t = run.take(holder.index)
        if run.remaining == 0 and gid is not None:
            del self.recomputed[gid]
        return t

    def forward_done(self) -> None:
        """Drop the forward's own tensors (rule 1)."""
        self.forward_tensors = None


class _Recompute:
    """One recompute of a frame for one backward (rules 2-4)."""

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame
        self.total = len(frame.meta)
        self.tensors: list[torch.Tensor | None] = [None] * self.total
        self.count = 0
        self.remaining = 0
        self.log: OpLog | None = None

    def take(self, index: int) -> torch.Tensor:
        t = self.tensors[index]
        if t is None:
            raise MegatronCoreError(
                f"checkpoint (non-reentrant): saved tensor #{index} was unpacked twice in one "
                "backward; a recomputed tensor is freed after its first use. Read "
                "ctx.saved_tensors once per backward in custom autograd Functions "
                "(NOTE [ Non-reentrant recompute ], rule 2)"
            )
        self.tensors[index] = None
        self.remaining -= 1
        return t

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Check ``t`` against the forward's, keep it for its holder, stop when all are back.

        Returns a detached alias when ``t`` requires grad: an op that saves its own output
        (exp, softmax) would otherwise hold that output, whose grad_fn is the op's node, in the
        node's packed data, a C++ reference cycle that leaks the recomputed graph.
        """
        if self.log is not None:
            with self.log.mute():
                return self._pack(t)
        return self._pack(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        frame, n = self.frame, self.count
        self.count = n + 1
        if n >= self.total:
            raise _Mismatch(f"forward saved {self.total} tensors, recompute saves more")
        shape, dtype = frame.meta[n]
        if t.shape != shape or t.dtype != dtype:
            raise _Mismatch(
                f"saved tensor #{n}: forward had {dtype} {list(shape)}, recompute "
                f"{t.dtype} {list(t.shape)} ({tensor_name(t)})"
            )
        if frame.check:
            problem = frame.fingerprints[n].mismatch(Fingerprint.of(t, "", values=True))
            if problem is not None:
                raise _Mismatch(f"{frame.fingerprints[n].name}: {problem}")
        x = t.detach() if t.requires_grad else t
        if frame.holders[n]() is not None:  # a dead holder: its node already ran
            self.tensors[n] = x
            self.remaining += 1
        if frame.early_stop and self.count == self.total:
            raise _StopRecomputation(self)  # rule 3
        return x

    def run(self) -> None:
        """Rebuild the inputs, replay RNG/autocast, run the function until all is back."""
        frame = self.frame
        kept = frame.saved.tensors
        if frame.enclosing_unpack is not None:
            kept = [frame.enclosing_unpack(h) for h in kept]
        args, kwargs = tree_unflatten(frame.saved.rebuild(kept), frame.spec)
        stopped = False
        log = OpLog() if frame.debug else contextlib.nullcontext()
        self.log = log if frame.debug else None
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(frame.state.replayed())  # RNG restored on any exit
                stack.enter_context(torch.enable_grad())
                stack.enter_context(checkpointing_region())
                stack.enter_context(_hooks(self.pack, _identity))
                if frame.recompute_context is not None:
                    stack.enter_context(frame.recompute_context)
                stack.enter_context(log)
                outputs = frame.function(*args, **kwargs)
        except _StopRecomputation as stop:
            if stop.args[0] is not self:
                raise
            stopped = True
        except _Mismatch as e:
            raise self._error(str(e)) from None
        if not stopped:
            if self.count != self.total:
                raise self._error(f"forward saved {self.total} tensors, recompute {self.count}")
            if frame.check:
                check_outputs(frame.output_fingerprints, outputs)

    def _error(self, what: str) -> MegatronCoreError:
        if self.log is not None and self.frame.forward_log is not None:
            what += "\n" + first_difference(self.frame.forward_log, self.log)
        return determinism_error(what)


def checkpoint_without_reentrant(
    function: Callable[..., Any],
    options: CheckpointOptions,
    args: tuple,
    kwargs: dict,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    debug: bool = False,
    early_stop: bool = True,
    keep_inputs: Callable[[list], Any] | None = None,
) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs for backward.

    Tensors anywhere inside ``args`` / ``kwargs`` (lists, tuples, dicts) are inputs. Works with
    ``torch.autograd.grad`` (also inside the function) and nests. Under ``torch.no_grad`` the
    function just runs. See NOTE [ Non-reentrant recompute ]. ``keep_inputs(leaves)``, when
    given, keeps the flattened inputs instead of :class:`SavedInputs` (deepspeed_checkpointing's
    partitions and contiguous buffers): an object with ``tensors`` (the kept tensors) and
    ``rebuild(tensors)`` (the inputs again), used until the graph is freed.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    forward_context, recompute_context = (
        context_fn() if context_fn is not None else (contextlib.nullcontext(), None)
    )
    leaves, spec = tree_flatten((args, kwargs))
    stack = _stack()
    enclosing = stack[-1] if stack else None
    if keep_inputs is not None:
        saved = keep_inputs(leaves)
    else:
        saved = SavedInputs(leaves, options, version_check=enclosing is None)
    extra = (_resolve_early_stop(early_stop), recompute_context, debug)
    frame = _Frame(function, spec, saved, options, extra)
    frame.keep_inputs_in(enclosing)
    log = OpLog() if debug else contextlib.nullcontext()
    frame.forward_log = log if debug else None
    try:
        with _hooks(frame.pack, frame.unpack), checkpointing_region(), forward_context, log:
            outputs = function(*args, **kwargs)
    finally:
        frame.forward_done()
    if frame.check:
        frame.output_fingerprints = output_fingerprints(outputs)
    return outputs
