"""Tensors handed to a gloo collective, and the frees a CPU memory timeline records.

# NOTE [ Frees the CPU profiler records ]
1. gloo's Work keeps the tensors a collective was given until gloo's worker thread lets the
   Work go, which can be after ``wait()`` returned. Where that thread drops the last reference,
   the storage is freed there, and torch's profiler, which records allocator events only on the
   threads it profiles, never sees the free (an all_reduce of 64 KiB between two CPU ranks lost
   its free in 5 of 20 runs). The recompute planner's MemoryTimeline (planner/probe.py) reads
   every CPU peak from those events: a lost free counts the tensor as live to the end of the
   step, so the CPU measurements of several ranks read high by a varying amount.
2. While a timeline records (:func:`recording_frees`), the package's collectives (those of
   tensor_parallel/_collectives.py, the host-side agreement's, vocab-parallel cross entropy's)
   hand gloo aliases of their tensors (:class:`Handed`) and, after the wait, drop the Work and
   yield until gloo's copies are gone (each storage back to the holders it had; at most
   ``_SETTLE_S``): every free then happens, and is recorded, on the thread that drops the
   tensor, as it is on CUDA, whose allocator counts frees on any thread. Outside a timeline,
   and for device tensors, the collectives are unchanged. gloo's point-to-point operations
   (the pipeline's, the context-parallel ring's) complete on the calling thread and keep no
   worker's reference: their frees were always seen.
3. gloo's reduce-scatter sums a copy of the input that it makes itself, inside the call, and
   keeps in its Work (then copies this rank's rows out): a tensor no caller holds, whose free
   rule 2 cannot wait for. While a timeline records, _collectives' reduce-scatter over gloo does
   the same steps itself: the input copied into a fresh buffer, an all-reduce of it, this
   rank's rows copied out; the same bytes, the same sum, every free seen.
4. The profiler learns a block's size when it sees the block allocated (in any session) and
   forgets it only when it sees the block freed. A block freed between sessions leaves its size
   behind: a later block at the same address, allocated between sessions and freed inside one,
   is recorded with the old block's size (a 5,056-byte RNG state freed as 16,384 bytes). malloc
   reuses addresses as it pleases, so the same pipeline step read up to 3% apart from run to
   run, and a planner test read its prediction 5.7% under the measured step. MemoryTimeline
   counts only the blocks allocated inside its own session, by address: the free of an older
   block is left out, whatever size the profiler gives it. The RNG streams' state tensors are
   the older blocks every step frees (each fork replaces them): the timeline re-creates them,
   same values, inside its session before it begins counting (``random.renew_stream_tensors``),
   so their frees count as they do on CUDA.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from megatron_core import compat

__all__ = ["Handed", "all_reduce_in_place", "is_recording", "recording_frees"]

_RECORDING = [0]  # open recording_frees contexts
_SETTLE_S = 0.05


@contextlib.contextmanager
def recording_frees():
    """While open, the package's collectives see to it that the frees of the CPU tensors they
    hand to gloo happen on the thread that drops them (NOTE [ Frees the CPU profiler records ])."""
    _RECORDING[0] += 1
    try:
        yield
    finally:
        _RECORDING[0] -= 1


def is_recording() -> bool:
    """Whether a :func:`recording_frees` context is open."""
    return _RECORDING[0] > 0


class Handed:
    """The tensors one collective is given: themselves, or under :func:`recording_frees` (CPU
    tensors) aliases, each storage's holders counted first, so that :meth:`settle` can wait
    until the finished Work has let its aliases go (rule 2).

    Use: ``handed = Handed(a, b)``; launch the collective on ``*handed.tensors``;
    :meth:`release`; wait for it and drop every reference to its Work; :meth:`settle`.
    """

    def __init__(self, *tensors: torch.Tensor) -> None:
        # the storages themselves are watched: a caller may swap a tensor's storage meanwhile
        # (a pipeline schedule frees a sent output's data while its send is in flight)
        self.watched: list[tuple[torch.UntypedStorage, int]] = []
        if _RECORDING[0] and all(t.device.type == "cpu" for t in tensors):
            storages = [t.untyped_storage() for t in tensors]
            self.watched = [(s, compat.storage_holders(s)) for s in storages]
            tensors = tuple(t.detach() for t in tensors)
        self.tensors = tensors

    def release(self) -> None:
        """Drop this side's aliases: the Work holds the only other copies."""
        self.tensors = ()

    def settle(self) -> None:
        """After the Work is done and dropped: yield until gloo's worker has let it go (at most
        ``_SETTLE_S`` seconds in all)."""
        give_up = time.monotonic() + _SETTLE_S
        for storage, holders in self.watched:
            while compat.storage_holders(storage) > holders and time.monotonic() < give_up:
                time.sleep(0)
        self.watched = []  # where a storage object here was the last holder, it is freed now


def all_reduce_in_place(tensor: torch.Tensor, op, group) -> None:
    """``dist.all_reduce(tensor, op, group)`` (synchronous, in place), its tensor handed so that
    a recording timeline sees its free (rule 2)."""
    handed = Handed(tensor)
    dist.all_reduce(*handed.tensors, op=op, group=group)
    handed.release()
    handed.settle()
