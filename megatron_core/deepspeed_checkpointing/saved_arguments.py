"""What a DeepSpeed-style checkpoint keeps of its arguments until backward: whole, as 1-D
partitions over the tensor-parallel group, on the CPU, in contiguous buffers (NOTE [ DeepSpeed
checkpointing ], rules 2-4, in __init__.py).

Which arguments are partitioned or offloaded, and the contiguous buffers, are DeepSpeed's; keeping
and rebuilding one tensor (split, CPU copy, gather, layout) is recompute's (saved_inputs.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.deepspeed_checkpointing.config import Settings
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.saved_inputs import (
    InputSlot,
    keep_tensor,
    rebuild_tensor,
)

__all__ = ["BUFFERS", "SavedArguments", "ContiguousBuffers"]

# --- contiguous buffers (rule 4) ---------------------------------------------------------------


class ContiguousBuffers:
    """num_layers preallocated chunk buffers per (argument position, numel, dtype, device)."""

    def __init__(self):
        self.generation = 0
        self.slots: dict[tuple, list[torch.Tensor]] = {}
        self.free_slots: dict[tuple, list[int]] = {}

    def free(self) -> None:
        """Drop every buffer; slots taken before are not given back into the new ones."""
        self.generation += 1
        self.slots, self.free_slots = {}, {}

    def take(self, key: tuple, count: int | None) -> tuple[torch.Tensor, Callable[[], None]]:
        """A free buffer for ``key`` and the function that gives it back."""
        if count is None:
            raise MegatronCoreError(
                "checkpoint: CONTIGUOUS_CHECKPOINTING is on but num_layers is None: pass "
                "num_checkpoints to configure() or call set_num_layers()"
            )
        if key not in self.slots:
            _, numel, dtype, where = key
            self.slots[key] = [torch.empty(numel, dtype=dtype, device=where) for _ in range(count)]
            self.free_slots[key] = list(range(count - 1, -1, -1))
        if not self.free_slots[key]:
            raise MegatronCoreError(
                f"checkpoint: more than num_checkpoints ({len(self.slots[key])}) checkpoints "
                "are waiting for backward with contiguous_checkpointing; raise num_checkpoints, "
                "or call reset() after forward passes that have no backward"
            )
        index = self.free_slots[key].pop()
        given = [False]
        generation = self.generation

        def give_back() -> None:  # idempotent: backward and the finalizer both call it
            if not given[0] and self.generation == generation:
                self.free_slots[key].append(index)
            given[0] = True

        return self.slots[key][index], give_back


BUFFERS = ContiguousBuffers()


# --- saved arguments (rules 2-4) -----------------------------------------------------------------


def _to_partition(x: torch.Tensor) -> bool:
    """Is ``x`` an activation DeepSpeed partitions/offloads (floating, not opted out)?"""
    return x.is_floating_point() and getattr(x, "no_checkpointing", False) is not True


class SavedArguments:
    """The arguments of one checkpoint as kept until its backward (rules 2-4)."""

    def __init__(
        self,
        args: Sequence[Any],
        settings: Settings,
        tp: tuple[int, int, dist.ProcessGroup | None],
    ):
        self.leaves = [None if torch.is_tensor(x) else x for x in args]
        self.slots: list[InputSlot] = []
        self.tensors: list[torch.Tensor] = []
        self.give_back: list[Callable[[], None]] = []
        self.tp = tp  # (size, rank, group) partitions split over
        floating = 0
        for index, x in enumerate(args):
            if not torch.is_tensor(x):
                continue
            chosen = _to_partition(x)
            split = chosen and settings.partition_activations
            if split:
                kept = self._partition(x, floating, settings)
                floating += 1
            elif chosen and settings.checkpoint_in_cpu:
                kept = keep_tensor(x, split=False, offload=True)
            else:
                kept = x
            self.tensors.append(kept)
            self.slots.append(InputSlot.of(index, x, split))
        # A graph dropped without backward gives its buffers back too.
        weakref.finalize(self, _give_back_all, list(self.give_back))

    def _partition(self, x: torch.Tensor, position: int, settings: Settings) -> torch.Tensor:
        size, _, group = self.tp
        offload = settings.checkpoint_in_cpu
        if not settings.contiguous_checkpointing:
            return keep_tensor(x, split=True, offload=offload, group=group, tp_size=size)
        chunk = keep_tensor(x, split=True, offload=False, group=group, tp_size=size)
        where = torch.device("cpu") if offload else chunk.device
        key = (position, chunk.numel(), chunk.dtype, where)
        buffer, give_back = BUFFERS.take(key, settings.num_checkpoints)
        self.give_back.append(give_back)
        return buffer.copy_(chunk)

    def rebuild(self, kept: Sequence[torch.Tensor]) -> list[Any]:
        """The arguments again (gathered, on their devices), detached, with their requires_grad."""
        leaves = list(self.leaves)
        size, _, group = self.tp
        for slot, t in zip(self.slots, kept):
            leaves[slot.index] = rebuild_tensor(t, slot, group=group, tp_size=size)
        return leaves

    def release(self) -> None:
        """Give this checkpoint's contiguous buffers back (its backward has read them)."""
        _give_back_all(self.give_back)


def _give_back_all(give_backs: Sequence[Callable[[], None]]) -> None:
    for give_back in give_backs:
        give_back()
