"""What a checkpoint keeps between forward and backward: inputs and RNG/autocast state.

Shared by the reentrant checkpoint (entry_points.py), the non-reentrant one
(nonreentrant.py) and CheckpointWithoutOutput (without_output.py). The rules
are NOTE [ Checkpoint rules ] in entry_points.py. The checksums of the determinism check live in
determinism.py (re-exported here). One tensor's keeping and rebuilding (:func:`keep_tensor`,
:class:`InputSlot`, :func:`rebuild_tensor`) also serve deepspeed_checkpointing's saved arguments,
which choose per tensor what to split and offload and may copy chunks into their own buffers.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import consistency, device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import (
    RNGSnapshot,
    get_cuda_rng_tracker,
    get_generator_states,
    get_rng_snapshot,
    set_generator_states,
    set_rng_snapshot,
)
from megatron_core.tensor_parallel.recompute.determinism import (  # noqa: F401 (re-exports)
    DETERMINISM_RTOL,
    Fingerprint,
    check_outputs,
    determinism_error,
    output_fingerprints,
    tensor_name,
)
from megatron_core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    "Distribute",
    "SavedInputs",
    "alias_outer_outputs",
    "capture_saved_inputs",
    "is_checkpointing",
]

_CHECKPOINTING_DEPTH = 0


def is_checkpointing() -> bool:
    """True while a checkpointed function runs: its forward or its recompute (megatron-core).

    Every checkpoint of this package (reentrant, non-reentrant, CheckpointWithoutOutput) counts;
    nested regions count once each, so the flag drops only when the outermost one ends.
    """
    return _CHECKPOINTING_DEPTH > 0


@contextlib.contextmanager
def checkpointing_region() -> Iterator[None]:
    """Inside the block :func:`is_checkpointing` is True."""
    global _CHECKPOINTING_DEPTH
    _CHECKPOINTING_DEPTH += 1
    try:
        yield
    finally:
        _CHECKPOINTING_DEPTH -= 1


class Distribute(str, enum.Enum):
    """Which inputs ``distribute_saved_activations=True`` splits over the TP group (rule 3)."""

    FIRST = "first"  # args[0] only, as megatron-core does
    ALL = "all"  # every floating-point tensor input with at least tp elements
    EVERY = "every"  # every floating-point tensor input, any size (padded, as DeepSpeed's)


@dataclass(frozen=True)
class CheckpointOptions:
    """A checkpoint call's settings, validated by entry_points.checkpoint.

    Attributes:
        distribute: which inputs to split (rule 3), or None to keep them whole.
        offload_to_cpu: keep the saved inputs on the CPU (rule 4).
        check_determinism: compare recomputed values with the forward's (rule 6).
        tp_group: the group to split over; None means parallel_state's TP group.
    """

    distribute: Distribute | None = None
    offload_to_cpu: bool = False
    check_determinism: bool = False
    tp_group: dist.ProcessGroup | None = None


# --- saved inputs (rules 1, 3, 4) --------------------------------------------------------------


@dataclass(frozen=True)
class InputSlot:
    """How one tensor input is kept and how to rebuild it (rules 1, 3, 4)."""

    index: int  # position among the flattened inputs
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    split: bool  # kept as this rank's 1-D chunk (rule 3)
    stride: tuple[int, ...]  # the input's layout, restored after the gather (rule 3)
    version: int | None = None  # _version when kept as given (non-reentrant checks it; rule 1)
    fingerprint: Fingerprint | None = None  # of a split input, with check_determinism (rule 6)

    @classmethod
    def of(
        cls,
        index: int,
        x: torch.Tensor,
        split: bool,
        version: int | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> InputSlot:
        """The slot of input ``x`` at ``index``: its shape, device, requires_grad and layout."""
        return cls(
            index, x.shape, x.device, x.requires_grad, split, x.stride(), version, fingerprint
        )


_CAPTURES: list[list[SavedInputs]] = []


class SavedInputs:
    """One checkpoint call's inputs as kept between forward and backward (rules 1, 3, 4).

    Non-tensor inputs are kept as they are. A tensor input is kept as given, as this rank's 1-D
    chunk (distributed), as a CPU copy (offloaded), or as a CPU copy of its chunk. The caller's
    tensors are never modified. The kept tensors are :attr:`tensors`, in slot order; the reentrant
    checkpoint hands them to ``ctx.save_for_backward`` and sets ``kept`` to read them back.

    Args:
        leaves: the flattened inputs.
        options: the call's settings.
        version_check: record each kept-as-given tensor's version and refuse to rebuild after an
            in-place change (the reentrant mode gets this check from save_for_backward instead).
    """

    def __init__(self, leaves: Sequence[Any], options: CheckpointOptions, version_check: bool):
        self.options = options
        self.leaves = [None if torch.is_tensor(x) else x for x in leaves]
        self.slots: list[InputSlot] = []
        self.tensors: list[Any] | None = []
        # Set by the reentrant checkpoint to read ctx.saved_tensors. Never a closure over self:
        # that cycle kept every input alive until the garbage collector ran.
        self.kept: Callable[[], Sequence[torch.Tensor]] | None = None
        split = _split_indices(leaves, options)
        for index, x in enumerate(leaves):
            if torch.is_tensor(x):
                self._keep(index, x, index in split, version_check)
        for found in _CAPTURES:
            found.append(self)

    def _keep(self, index: int, x: torch.Tensor, split: bool, version_check: bool) -> None:
        offload = self.options.offload_to_cpu
        if split:  # See NOTE [ Checkpoint rules ], rule 3: agreed, then a chunk copy.
            self._agree_distributed(x.detach())
        kept = keep_tensor(x, split=split, offload=offload, group=self.group)
        as_given = not split and not offload
        version = x._version if as_given and version_check else None
        self.tensors.append(x if as_given and not version_check else kept)
        name = f"distributed input #{len(self.slots)} ({tensor_name(x)})"
        check = split and self.options.check_determinism
        fingerprint = Fingerprint.of(x, name, values=True) if check else None
        self.slots.append(InputSlot.of(index, x, split, version, fingerprint))

    def _agree_distributed(self, x: torch.Tensor) -> None:
        """Rule 3: agree ``x`` (shape, dtype, checksum) across the TP group when the consistency
        mode says so; a differing input raises on every rank, naming this checkpoint's input."""
        group = self.group or parallel_state.get_tensor_model_parallel_group()
        op = f"checkpoint(distribute_saved_activations=True) input #{len(self.slots)}"
        consistency.check_collective(op, group, x, content=x)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group distributed inputs are split over (None for parallel_state's TP group)."""
        return self.options.tp_group

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The inputs again, tensors detached with their forward ``requires_grad`` (rules 3, 4).

        Gathers distributed inputs over the TP group: every TP rank must call this.

        Raises:
            MegatronCoreError: a tensor kept as given was modified in place since forward.
        """
        leaves = list(self.leaves)
        for n, (slot, kept) in enumerate(zip(self.slots, tensors)):
            if slot.version is not None and kept._version != slot.version:
                raise MegatronCoreError(
                    f"checkpoint: input tensor #{n} (shape {list(slot.shape)}) was modified in "
                    f"place after checkpoint() received it, in the function or before backward "
                    f"(version {slot.version} -> {kept._version}); the recompute would read the "
                    "new values. Pass a clone (checkpoint(fn, ..., x.clone())) or make the change "
                    "out of place (NOTE [ Checkpoint rules ], rule 1)"
                )
            leaves[slot.index] = rebuild_tensor(kept, slot, group=self.group)
        return leaves

    def nbytes(self) -> int:
        """Bytes of storage held by the kept tensors (each storage counted once); a debug aid."""
        storages = {}
        for t in self.kept() if self.kept is not None else self.tensors or ():
            if torch.is_tensor(t):
                storage = t.untyped_storage()
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
        return sum(storages.values())


def keep_tensor(
    x: torch.Tensor,
    *,
    split: bool,
    offload: bool,
    group: dist.ProcessGroup | None = None,
    tp_size: int | None = None,
) -> torch.Tensor:
    """``x`` detached as a checkpoint keeps it until backward (rules 3, 4); ``x`` is not changed.

    Args:
        x: the input.
        split: keep this rank's 1-D chunk of ``x`` over ``group`` (a new tensor).
        offload: keep it on the CPU (the chunk when split: split first, then offload; a copy).
        group: the group to split over; None means parallel_state's TP group.
        tp_size: the size of the group when the caller knows it; 1 keeps the whole of ``x``
            flattened (a copy) and needs no group. Pass the same to :func:`rebuild_tensor`.

    Returns:
        ``x.detach()`` itself when neither splitting nor offloading, else a new tensor.
    """
    kept = x.detach()
    if split and tp_size == 1:
        kept = kept.reshape(-1).clone()
    elif split:
        kept = split_tensor_into_1d_equal_chunks(kept, new_buffer=True, group=group)
    if offload:
        kept = kept.to("cpu", copy=not split)  # a chunk is already a fresh buffer
    return kept


def rebuild_tensor(
    kept: torch.Tensor,
    slot: InputSlot,
    *,
    group: dist.ProcessGroup | None = None,
    tp_size: int | None = None,
) -> torch.Tensor:
    """The input of ``slot`` again from what :func:`keep_tensor` kept (rules 3, 4).

    Moved back to the input's device; a split input gathered over ``group`` (every rank of it
    must call this; not with ``tp_size`` 1), given its shape and layout back, and checked with
    its fingerprint. Returned detached, with the input's ``requires_grad``.
    """
    if kept.device != slot.device:
        kept = kept.to(slot.device)
    if slot.split:
        if tp_size != 1:
            kept = gather_split_1d_tensor(kept, numel=slot.shape.numel(), group=group)
        kept = with_strides(kept.view(slot.shape), slot.stride)
        _check_gathered(slot, kept, group)
    return kept.detach().requires_grad_(slot.requires_grad)


def with_strides(t: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """``t`` (contiguous) copied into the layout ``stride`` of the input it was gathered for.

    A kernel may take another path for another layout (F.linear reshapes a non-contiguous input
    and saves the copy; a bf16 matmul rounds differently), and the recompute must repeat the
    forward exactly (rules 2, 5). Expanded layouts (a zero stride) and overlapping ones stay
    contiguous: only their values matter.
    """
    stride = tuple(stride)
    if not stride or t.stride() == stride or 0 in stride:
        return t
    try:
        out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
        return out.copy_(t)
    except RuntimeError:  # an overlapping layout
        return t


def _check_gathered(
    slot: InputSlot, gathered: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """With check_determinism: the gathered input must be this rank's forward input (rule 3).

    The ranks agree on the outcome first (one all-reduce over the TP group), so either every rank
    raises or none does: a rank whose own input happens to match the gathered one would otherwise
    go on into the backward's collectives and wait there forever.
    """
    if slot.fingerprint is None:
        return
    problem = slot.fingerprint.mismatch(Fingerprint.of(gathered, "", values=True))
    failed = torch.tensor([0 if problem is None else 1], device=gathered.device)
    if group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if int(failed.item()) == 0:
        return
    problem = problem or "it matches here, but not on another rank of the TP group"
    raise MegatronCoreError(
        f"checkpoint: {slot.fingerprint.name} gathered over the TP group is not this rank's "
        f"forward input ({problem}); a distributed input must be the same on every rank of "
        "the TP group (NOTE [ Checkpoint rules ], rule 3)"
    )


def _split_indices(leaves: Sequence[Any], options: CheckpointOptions) -> set[int]:
    """Positions of the inputs to keep as 1-D chunks (rule 3); none over a one-rank group."""
    if options.distribute is None:
        return set()
    if options.tp_group is None:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    else:
        tp_size = dist.get_world_size(options.tp_group)
    if tp_size == 1:  # the one chunk would be a copy of the whole input
        return set()
    if options.distribute is Distribute.FIRST:
        return {0}
    least = 0 if options.distribute is Distribute.EVERY else tp_size
    return {
        i
        for i, x in enumerate(leaves)
        if torch.is_tensor(x) and x.is_floating_point() and x.numel() >= least
    }


@contextlib.contextmanager
def capture_saved_inputs() -> Iterator[list[SavedInputs]]:
    """Collect the :class:`SavedInputs` of every checkpoint called inside the block (debug aid).

    ``SavedInputs.nbytes()`` tells how much input storage a checkpoint keeps until backward, e.g.
    ``ceil(numel / tp) * element_size`` for a distributed input.

    Example::

        with capture_saved_inputs() as saved:
            out = checkpoint(fn, True, x)
        print(saved[0].nbytes())
    """
    found: list[SavedInputs] = []
    _CAPTURES.append(found)
    try:
        yield found
    finally:
        _CAPTURES.remove(found)


# --- RNG and autocast replay (rule 2) ----------------------------------------------------------


def _autocast_states() -> list[tuple[str, dict[str, Any]]]:
    kinds = dict.fromkeys([device.device_type(), "cpu"])  # cpu autocast matters on cuda too
    cache = torch.is_autocast_cache_enabled()
    return [
        (
            kind,
            {
                "enabled": torch.is_autocast_enabled(kind),
                "dtype": torch.get_autocast_dtype(kind),
                "cache_enabled": cache,
            },
        )
        for kind in kinds
    ]


# (tracker, its state objects when copied, the copies): see _rng_snapshot.
_TRACKER_COPIES: list[tuple[Any, dict[str, Any], Mapping[str, Any]]] = []


def _rng_snapshot() -> RNGSnapshot:
    """get_rng_snapshot(), sharing the tracker-state copies with the previous snapshot when no
    stream moved since (nested regions, consecutive regions without tracker draws between).

    Sound because the tracker replaces a stream's state object whenever it changes (a fork
    stores a new tensor on exit; set_states and add build new ones) and a copy is never
    written to (NOTE [ RNG streams ], rule 5). Graph-safe states (torch.Generator objects that
    change in place) and trackers without ``states_`` are copied every time.
    """
    tracker = get_cuda_rng_tracker()
    states = getattr(tracker, "states_", None)
    shareable = (
        isinstance(states, dict)
        and getattr(tracker, "_active", None) is None
        and all(type(v) is torch.Tensor for v in states.values())
    )
    if not shareable:
        return get_rng_snapshot()
    if _TRACKER_COPIES:
        owner, sources, copies = _TRACKER_COPIES[0]
        same = owner is tracker and sources.keys() == states.keys()
        if same and all(sources[k] is v for k, v in states.items()):
            cpu_state, device_state = get_generator_states()
            return RNGSnapshot(device.device_type(), cpu_state, device_state, copies, None)
    snapshot = get_rng_snapshot()
    _TRACKER_COPIES[:] = [(tracker, dict(states), snapshot.tracker_states)]
    return snapshot


@dataclass(frozen=True)
class ForwardState:
    """The RNG snapshot, autocast state and torch-function modes current when a checkpoint's
    forward ran (rule 2)."""

    rng: RNGSnapshot
    autocast: list[tuple[str, dict[str, Any]]]
    modes: tuple[Any, ...] = ()

    @classmethod
    def capture(cls) -> ForwardState:
        """Snapshot the CPU, device and tracker RNG states, the autocast state and this
        thread's torch-function mode stack now."""
        modes = tuple(torch.overrides._get_current_function_mode_stack())
        return cls(_rng_snapshot(), _autocast_states(), modes)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside: the forward's RNG and autocast state, and each of its torch-function modes
        that is not on the stack now (torch runs backward without the mode whose handler
        dispatched it, where it lacks ``torch.overrides.redispatch_function``). After (also on
        error): the RNG states current before the block and the mode stack as it was. See
        NOTE [ Checkpoint rules ], rule 2."""
        restore = _stash_rng()
        set_rng_snapshot(self.rng)
        try:
            with contextlib.ExitStack() as stack:
                current = torch.overrides._get_current_function_mode_stack()
                for mode in self.modes:
                    if not any(mode is other for other in current):
                        stack.enter_context(mode)
                for kind, kwargs in self.autocast:
                    stack.enter_context(torch.autocast(device_type=kind, **kwargs))
                yield
        finally:
            restore()


def _stash_rng() -> Callable[[], None]:
    """The RNG states current now, as a function that restores them (rule 2).

    The tracker's stream states are held by reference, not copied: set_rng_snapshot gives the
    tracker a new dict, and a fork replaces a state object instead of changing it (see
    _rng_snapshot), so the dict put back is exactly the one taken. Graph-safe states and
    trackers without these attributes take a full snapshot copy instead.
    """
    tracker = get_cuda_rng_tracker()
    states = getattr(tracker, "states_", None)
    plain = (
        isinstance(states, dict)
        and hasattr(tracker, "_active")
        and hasattr(tracker, "_is_initialized")
        and all(type(v) is torch.Tensor for v in states.values())
    )
    if not plain:
        snapshot = get_rng_snapshot()
        return lambda: set_rng_snapshot(snapshot)
    cpu_state, device_state = get_generator_states()  # NOTE [ RNG streams ], rule 6
    active, initialized = tracker._active, tracker._is_initialized

    def restore() -> None:
        tracker.states_, tracker._active, tracker._is_initialized = states, active, initialized
        set_generator_states(cpu_state, device_state)  # after the active stream (rule 6)

    return restore


def alias_outer_outputs(outputs: Any) -> Any:
    """The outputs of a region that ran without grad, each tensor that requires grad replaced by
    a detached alias (same storage).

    Inside a Function's forward nothing new requires grad, so such a tensor existed before the
    region: a parameter or an input returned as is (megatron-core's MLP returns its fc2 bias
    when the bias is added later). Returned through the Function itself it would take the
    Function as its grad_fn: a parameter would stop being a leaf (its ``.grad`` never filled)
    and the recompute, which returns that tensor again, would backpropagate into the same node
    without end. The alias takes its place in the graph; :func:`backward_through` hands the
    alias's gradient to the tensor the recompute returns (a leaf accumulates it in ``.grad``).
    """
    if torch.is_tensor(outputs):
        return outputs.detach() if outputs.requires_grad else outputs
    if isinstance(outputs, tuple):
        return tuple(o.detach() if torch.is_tensor(o) and o.requires_grad else o for o in outputs)
    return outputs


def backward_through(
    outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any]
) -> tuple[torch.Tensor | None, ...]:
    """Backpropagate ``grad_outputs`` through the recomputed ``outputs``; return the inputs' grads.

    Outputs that are not tensors or do not require grad are skipped; an input that does not
    require grad gets None.

    Raises:
        MegatronCoreError: no output requires grad (torch.utils.checkpoint raises too).
    """
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grad_outputs)
        if torch.is_tensor(out) and out.requires_grad
    ]
    if not pairs:
        raise MegatronCoreError(
            "checkpoint: none of the recomputed outputs requires grad, so backward cannot reach "
            "the inputs and this checkpoint is not necessary: call the function without "
            "checkpoint, or return outputs that depend on the inputs without detaching them"
        )
    torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    return tuple(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs)
