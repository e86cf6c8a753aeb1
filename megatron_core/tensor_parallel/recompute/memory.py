"""Activation-memory accounting: the bytes autograd keeps for backward, per region and in total.

Example::

    from megatron_core.tensor_parallel.recompute.memory import count_saved_activations

    with count_saved_activations(ignore=model.parameters()) as report:
        for i, layer in enumerate(layers):
            with report.region(f"layer{i}"):
                hidden = layer(hidden)
    print(report.total_bytes, report.by_region, report.held_bytes)
    hidden.sum().backward()
    assert report.held_bytes == 0  # the graph, and with it every saved tensor, is gone

# NOTE [ Saved-activation accounting ]
1. What is counted. Every tensor that autograd saves for backward while the block runs reaches
   the pack hook of a ``torch.autograd.graph.saved_tensors_hooks`` pair installed by
   :func:`count_saved_activations`: tensors saved by torch ops and by ``ctx.save_for_backward``.
   Parameters are saved like any tensor (a linear layer saves its weight); pass them as
   ``ignore`` to count activations only. Nothing is saved under ``torch.no_grad``.
2. Unique storages. A tensor is counted as the whole storage it lives in (``untyped_storage()``
   nbytes), keyed by (device, data pointer): views of one storage and a tensor saved twice count
   once, and a saved slice counts its whole base, because the base is what stays allocated.
   Zero-byte storages count nothing. The device does not matter: CPU and accelerator tensors are
   counted alike, and :attr:`SavedActivationReport.by_device` splits the total.
3. Total and held. ``total_bytes`` is the sum over every storage saved during the block: what
   one forward makes autograd keep, the number the activation-memory formulas predict. ``held``
   bytes are those of the counted storages that saved-tensor packs (rule 1) or kept checkpoint
   inputs (rule 6) still reference now; they fall as backward frees the graph, also after the
   block ended. ``peak_held_bytes`` is their maximum. A storage whose last pack died and that is
   saved again counts again (its address may have been reused by another tensor). Run backward
   after the block: inside it, a reentrant checkpoint's recompute would be counted as well.
4. Regions. ``report.region(name)`` attributes what is saved inside it to ``name``; nested
   regions attribute to the innermost, a name entered twice accumulates, and a storage counts
   for the region that saved it first. ``unattributed_bytes`` were saved outside every region.
5. Other hooks. Only the innermost pair of saved-tensor hooks runs. A pair installed inside the
   block (a non-reentrant checkpoint, CPU offload hooks) hides what is saved within it: the
   counter sees what that pair's code saves outside it, e.g. the inputs torch's non-reentrant
   checkpoint keeps. A pair that is active when the block starts is called by the counter, so an
   enclosing checkpoint still works; the counter then counts what was offered for saving, and
   the enclosing pair decides what is really kept. (The enclosing pair is read through torch's
   private ``torch._C._autograd._top_saved_tensors_default_hooks``; a torch without it gets no
   forwarding, and the counter's pair then hides what is saved from the enclosing one.)
6. megatron_core checkpoints. The reentrant ``checkpoint`` and ``CheckpointWithoutOutput`` keep
   their inputs through ``save_for_backward`` (rule 1). The non-reentrant ``checkpoint`` keeps
   them outside any hook, so the counter collects them through ``capture_saved_inputs`` (its
   full input, its 1-D chunk when distributed, or its CPU copy when offloaded), attributed to the
   region in which the checkpoint ran. Pass ``include_checkpoint_inputs=False`` to skip them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from megatron_core import compat
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.entry_points import capture_saved_inputs

__all__ = ["SavedActivationReport", "count_saved_activations", "storage_key_and_nbytes"]

_Key = tuple[Any, ...]


def storage_key_and_nbytes(t: torch.Tensor) -> tuple[_Key | None, int]:
    """The identity and size of the storage that holds ``t`` (NOTE [ Saved-activation
    accounting ], rule 2).

    Returns:
        ``((device, data_ptr), nbytes)``; the key is None when the tensor has no addressable
        storage (a meta tensor, a tensor subclass without one): such a tensor counts as
        ``numel * element_size`` and is never merged with another.
    """
    try:
        storage = t.untyped_storage()
        pointer = storage.data_ptr()
        nbytes = storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, t.numel() * t.element_size()
    if pointer == 0 or t.device.type == "meta":
        return None, nbytes
    return (str(t.device), pointer), nbytes


def _weak_storage(t: torch.Tensor) -> Callable[[], Any]:
    """A weak reference to ``t``'s storage (torch keeps a storage's Python object alive as long
    as the storage lives), or a callable returning None where there is none."""
    try:
        return weakref.ref(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return lambda: None


class _Packed:
    """What the graph holds instead of a saved tensor while the counter is active."""

    __slots__ = ("payload", "__weakref__")

    def __init__(self, payload: Any):
        self.payload = payload


class SavedActivationReport:
    """Bytes saved for backward during a :func:`count_saved_activations` block.

    Attributes:
        total_bytes: unique storage bytes saved during the block (rules 2, 3).
        by_region: region name -> bytes of ``total_bytes`` saved inside it (rule 4).
        by_device: device string (``"cpu"``, ``"cuda:0"``) -> bytes of ``total_bytes``.
        num_saved: tensors handed to autograd for saving (before merging storages).
        peak_held_bytes: the most bytes held at once since the block started (rule 3).
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()):
        self.total_bytes = 0
        self.by_region: dict[str, int] = {}
        self.by_device: dict[str, int] = {}
        self.num_saved = 0
        self.peak_held_bytes = 0
        self._held = 0
        self._live: dict[_Key, list[int]] = {}  # key -> [nbytes, number of live references]
        self._storages: dict[_Key, Callable[[], Any]] = {}  # key -> weak ref to the storage
        self._regions: list[str] = []
        self._ignored = {storage_key_and_nbytes(t)[0] for t in ignore} - {None}
        self._lock = threading.RLock()  # a finalizer may run during a locked section
        self._drain: Callable[[], None] = lambda: None

    @property
    def held_bytes(self) -> int:
        """Bytes of counted storages that saved-tensor packs still reference now (rule 3)."""
        return self._held

    @property
    def unattributed_bytes(self) -> int:
        """Bytes of ``total_bytes`` saved outside every region."""
        return self.total_bytes - sum(self.by_region.values())

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Attribute what is saved inside the block to ``name`` (innermost region wins, rule 4).

        Raises:
            MegatronCoreError: ``name`` is not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise MegatronCoreError(f"region name ({name!r}) must be a non-empty string")
        self._drain()  # checkpoint inputs kept so far belong to the enclosing region
        self._regions.append(name)
        try:
            yield
        finally:
            self._drain()
            self._regions.pop()

    def record(self, t: torch.Tensor, owner: object) -> None:
        """Count ``t`` as saved; it stays held until ``owner`` is garbage (rules 2, 3).

        :func:`count_saved_activations` calls this for every saved tensor; call it yourself for
        tensors that your own code keeps for backward outside saved-tensor hooks.
        """
        key, nbytes = storage_key_and_nbytes(t)
        if nbytes == 0 or (key is not None and key in self._ignored):
            return
        if key is None:
            key = ("unaddressable", id(owner))
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and not self._same_storage(key, t):
                # The address was released (CheckpointWithoutOutput resizes a storage to 0) and
                # reused by another storage while the first is still referenced: not a view of
                # it, so it counts on its own.
                key = (*key, id(t.untyped_storage()))
                entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [nbytes, 0]
                self._add_new(nbytes, str(t.device))
                self._storages[key] = _weak_storage(t)
            entry[1] += 1
        weakref.finalize(owner, self._release, key, entry)

    def _add_new(self, nbytes: int, device_name: str) -> None:
        self.total_bytes += nbytes
        self.by_device[device_name] = self.by_device.get(device_name, 0) + nbytes
        if self._regions:
            region = self._regions[-1]
            self.by_region[region] = self.by_region.get(region, 0) + nbytes
        self._held += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self._held)

    def _release(self, key: _Key, entry: list[int]) -> None:
        with self._lock:
            entry[1] -= 1
            if entry[1] == 0:
                self._held -= entry[0]
                if self._live.get(key) is entry:
                    del self._live[key]
                    self._storages.pop(key, None)

    def _same_storage(self, key: _Key, t: torch.Tensor) -> bool:
        storage = self._storages.get(key, lambda: None)()
        try:
            return storage is None or storage is t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return True

    def resident_bytes(self) -> int:
        """Bytes the held storages occupy now: :attr:`held_bytes`, less what was released
        since it was saved (``CheckpointWithoutOutput`` resizes an output's storage to 0 until
        backward recomputes it). A storage whose size cannot be read now counts as saved."""
        with self._lock:
            total = 0
            for key, entry in self._live.items():
                storage = self._storages.get(key, lambda: None)()
                total += entry[0] if storage is None else storage.nbytes()
            return total

    def __repr__(self) -> str:
        return (
            f"SavedActivationReport(total_bytes={self.total_bytes}, held_bytes={self._held}, "
            f"peak_held_bytes={self.peak_held_bytes}, by_region={self.by_region})"
        )


def _hook_pair(
    report: SavedActivationReport,
) -> tuple[Callable[[torch.Tensor], _Packed], Callable[[_Packed], torch.Tensor]]:
    """Pack/unpack hooks that count into ``report`` and forward to the enclosing pair (rule 5)."""
    enclosing = compat.enclosing_saved_tensors_hooks()

    def pack(t: torch.Tensor) -> _Packed:
        report._drain()
        report.num_saved += 1
        # The docs of saved_tensors_hooks: never keep the input itself (a reference cycle for
        # outputs); detach() shares storage and version counter.
        packed = _Packed(enclosing[0](t) if enclosing is not None else t.detach())
        report.record(t, packed)
        return packed

    def unpack(packed: _Packed) -> torch.Tensor:
        if enclosing is not None:
            return enclosing[1](packed.payload)
        return packed.payload

    return pack, unpack


def _checkpoint_input_drain(report: SavedActivationReport, found: list[Any]) -> Callable[[], None]:
    """Counts the inputs kept by non-reentrant checkpoints created since the last call (rule 6)."""
    seen = 0

    def drain() -> None:
        nonlocal seen
        while seen < len(found):
            saved = found[seen]
            seen += 1
            for t in saved.tensors or ():  # None: reentrant, counted by the hooks
                if torch.is_tensor(t):  # not a tensor: packed by an enclosing checkpoint
                    report.record(t, t)

    return drain


@contextlib.contextmanager
def count_saved_activations(
    ignore: Iterable[torch.Tensor] = (),
    include_checkpoint_inputs: bool = True,
) -> Iterator[SavedActivationReport]:
    """Count the bytes autograd saves for backward inside the block.

    See NOTE [ Saved-activation accounting ] in this module for what is counted and how.

    Args:
        ignore: tensors whose storages are not counted, typically ``model.parameters()``.
        include_checkpoint_inputs: also count the inputs that megatron_core's non-reentrant
            checkpoints keep outside saved-tensor hooks (rule 6).

    Yields:
        A :class:`SavedActivationReport`, filled while the block runs; its held bytes keep
        falling as backward frees saved tensors after the block.

    Raises:
        MegatronCoreError: ``include_checkpoint_inputs`` is not a bool.
    """
    if not isinstance(include_checkpoint_inputs, bool):
        raise MegatronCoreError(
            f"include_checkpoint_inputs ({include_checkpoint_inputs!r}) must be a bool"
        )
    report = SavedActivationReport(ignore)
    with contextlib.ExitStack() as stack:
        if include_checkpoint_inputs:
            found = stack.enter_context(capture_saved_inputs())
            report._drain = _checkpoint_input_drain(report, found)
        stack.enter_context(saved_tensors_hooks(*_hook_pair(report)))
        try:
            yield report
        finally:
            report._drain()
            report._drain = lambda: None
