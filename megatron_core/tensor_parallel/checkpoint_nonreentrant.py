"""Non-reentrant checkpoint: torch.autograd.graph.saved_tensors_hooks with distributed inputs.

``checkpoint(..., use_reentrant=False)`` lands here. See NOTE [ Checkpoint rules ] in
checkpointing.py, rule 5 for the mechanism; rules 1-4 and 6 apply unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.checkpoint_inputs import (
    CheckpointOptions,
    Fingerprint,
    ForwardState,
    SavedInputs,
    check_outputs,
    determinism_error,
    output_fingerprints,
    tensor_name,
)

__all__ = ["checkpoint_without_reentrant"]

_EMPTY = object()


class _Holder:
    """Stands in the autograd graph for one saved tensor; the recompute fills ``value``."""

    __slots__ = ("value", "__weakref__")

    def __init__(self) -> None:
        self.value: Any = _EMPTY


# The (pack, unpack) pairs of the non-reentrant checkpoints running in this thread, innermost
# last. An inner checkpoint keeps its inputs through the enclosing pair (rule 5, nesting).
_local = threading.local()


def _stack() -> list[tuple[Callable, Callable]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def _hooks(pack: Callable, unpack: Callable) -> Iterator[None]:
    _stack().append((pack, unpack))
    try:
        with saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _stack().pop()


def _identity(x: Any) -> Any:
    return x


class _Frame:
    """One non-reentrant checkpoint call: its inputs, forward state and holders (rule 5)."""

    def __init__(self, function: Callable, spec: Any, saved: SavedInputs, check: bool):
        self.function = function
        self.spec = spec
        self.saved = saved
        self.check = check
        self.state = ForwardState.capture()
        self.enclosing_unpack: Callable | None = None
        self.holders: list[weakref.ref[_Holder]] = []
        self.fingerprints: list[Fingerprint] = []
        self.output_fingerprints: list[Fingerprint] = []
        self.recomputed = False
        self.count = 0

    def keep_inputs_in(self, enclosing: tuple[Callable, Callable] | None) -> None:
        """Pass the kept inputs through the enclosing checkpoint's hooks when nested."""
        if enclosing is not None:
            pack, self.enclosing_unpack = enclosing
            self.saved.tensors = [pack(t) for t in self.saved.tensors]

    def pack(self, t: torch.Tensor) -> _Holder:
        """Forward: remember what was saved, keep nothing of it."""
        holder = _Holder()
        self.holders.append(weakref.ref(holder))
        n = len(self.fingerprints)
        self.fingerprints.append(
            Fingerprint.of(t, f"saved tensor #{n} ({tensor_name(t)})", values=self.check)
        )
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        """Backward: recompute the region on first use, then hand out the holder's tensor."""
        if not self.recomputed:
            self._recompute()
        if holder.value is _EMPTY:
            raise MegatronCoreError(
                "checkpoint (non-reentrant): a saved tensor was not recomputed; the function "
                "saved fewer tensors when recomputed (NOTE [ Checkpoint rules ], rule 5)"
            )
        return holder.value

    def pack_recompute(self, t: torch.Tensor) -> torch.Tensor:
        """Recompute: check the tensor against the forward's and fill its holder.

        Returns a detached alias, never ``t`` itself: an op that saves its own output (softmax,
        exp, ...) would otherwise hold that output, whose grad_fn is the op's node, in the node's
        packed data, a C++ reference cycle the garbage collector cannot see that leaks the whole
        recomputed graph and every activation it saved, once per backward.
        """
        n = self.count
        self.count += 1
        if n >= len(self.fingerprints):
            raise determinism_error(
                f"forward saved {len(self.fingerprints)} tensors, recompute saves more"
            )
        expected = self.fingerprints[n]
        problem = expected.mismatch(Fingerprint.of(t, "", values=self.check))
        if problem is not None:
            raise determinism_error(f"{expected.name}: {problem}")
        kept = t.detach()
        holder = self.holders[n]()
        if holder is not None:  # a dead holder: its node already ran and freed it
            holder.value = kept if t.requires_grad else t
        return kept

    def _recompute(self) -> None:
        """Rule 2: rebuild inputs, replay RNG/autocast, run with grad, restore RNG, check."""
        kept = self.saved.tensors
        if self.enclosing_unpack is not None:
            kept = [self.enclosing_unpack(h) for h in kept]
        args, kwargs = tree_unflatten(self.saved.rebuild(kept), self.spec)
        self.count = 0
        with self.state.replayed(), torch.enable_grad(), _hooks(self.pack_recompute, _identity):
            outputs = self.function(*args, **kwargs)
        if self.count != len(self.fingerprints):
            raise determinism_error(
                f"forward saved {len(self.fingerprints)} tensors, recompute {self.count}"
            )
        if self.check:
            check_outputs(self.output_fingerprints, outputs)
        self.recomputed = True
        self.saved.tensors = None  # every live holder is filled: the inputs are not needed


def checkpoint_without_reentrant(
    function: Callable[..., Any], options: CheckpointOptions, args: tuple, kwargs: dict
) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs for backward (rule 5).

    Tensors anywhere inside ``args`` / ``kwargs`` (lists, tuples, dicts) are inputs. Works with
    ``torch.autograd.grad`` and nests. Under ``torch.no_grad`` the function just runs.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    enclosing = _stack()[-1] if _stack() else None
    saved = SavedInputs(leaves, options, version_check=enclosing is None)
    frame = _Frame(function, spec, saved, options.check_determinism)
    frame.keep_inputs_in(enclosing)
    with _hooks(frame.pack, frame.unpack):
        outputs = function(*args, **kwargs)
    if frame.check:
        frame.output_fingerprints = output_fingerprints(outputs)
    return outputs
