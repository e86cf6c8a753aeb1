"""What a DeepSpeed-style checkpoint keeps of its arguments until backward: whole, as 1-D
partitions over the tensor-parallel group, on the CPU, in contiguous buffers (NOTE [ DeepSpeed
checkpointing ], rules 2-4, in __init__.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.saved_inputs import with_strides
from megatron_core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
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
        settings: dict[str, Any],
        tp: tuple[int, int, dist.ProcessGroup | None],
    ):
        self.leaves = [None if torch.is_tensor(x) else x for x in args]
        self.slots: list[tuple[int, torch.Size, tuple, torch.device, bool, bool]] = []
        self.tensors: list[torch.Tensor] = []
        self.give_back: list[Callable[[], None]] = []
        self.tp = tp  # (size, rank, group) partitions split over
        floating = 0
        for index, x in enumerate(args):
            if not torch.is_tensor(x):
                continue
            chosen = _to_partition(x)
            split = chosen and settings["partition"]
            if split:
                kept = self._partition(x.detach(), floating, settings)
                floating += 1
            elif chosen and settings["cpu"]:
                kept = x.detach().to("cpu", copy=True)
            else:
                kept = x
            self.tensors.append(kept)
            self.slots.append((index, x.shape, x.stride(), x.device, x.requires_grad, split))
        # A graph dropped without backward gives its buffers back too.
        weakref.finalize(self, _give_back_all, list(self.give_back))

    def _partition(self, x: torch.Tensor, position: int, settings: dict[str, Any]):
        size, _, group = self.tp
        if size == 1:
            chunk = x.reshape(-1).clone()
        else:
            chunk = split_tensor_into_1d_equal_chunks(x, new_buffer=True, tp_group=group)
        where = torch.device("cpu") if settings["cpu"] else chunk.device
        if settings["contiguous"]:
            key = (position, chunk.numel(), chunk.dtype, where)
            buffer, give_back = BUFFERS.take(key, settings["num_layers"])
            self.give_back.append(give_back)
            return buffer.copy_(chunk)
        return chunk.to(where)

    def rebuild(self, kept: Sequence[torch.Tensor]) -> list[Any]:
        """The arguments again (gathered, on their devices), detached, with their requires_grad."""
        leaves = list(self.leaves)
        size, _, group = self.tp
        for (index, shape, stride, where, requires_grad, split), t in zip(self.slots, kept):
            t = t.to(where)
            if split:
                if size > 1:
                    t = gather_split_1d_tensor(t, numel=shape.numel(), tp_group=group)
                t = with_strides(t.view(shape), stride)
            leaves[index] = t.detach().requires_grad_(requires_grad)
        return leaves

    def release(self) -> None:
        _give_back_all(self.give_back)


def _give_back_all(give_backs: Sequence[Callable[[], None]]) -> None:
    for give_back in give_backs:
        give_back()
