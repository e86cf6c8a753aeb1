"""The storage side of training checkpoints: DCP planners for shards, safe metadata reading,
checksums, atomic directory moves and cross-rank agreement on errors.

``torch.distributed.checkpoint`` (DCP) cuts tensors with DTensor or ShardedTensor; our shards
(``checkpoint_state.Shard``) are plain tensors with a global shape and offsets, which may be
uneven (a padded vocabulary), so two small planners describe them to DCP with its own chunk
metadata (``ChunkStorageMetadata``): DCP then writes each distinct chunk once and reads any
overlap of saved chunks into any new cut (resharding).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.training.checkpoint_state import Shard

__all__ = [
    "TRACKER_FILENAME",
    "MANIFEST_FILENAME",
    "FORMAT",
    "unreadable",
    "VERSION",
    "checkpoint_layout",
    "ShardSavePlanner",
    "ShardLoadPlanner",
    "SafeFileSystemReader",
    "OSErrorFileSystemWriter",
    "read_metadata",
    "sha256_of",
    "fsync_path",
    "all_gather_text",
    "agree",
]

_HASH_CHUNK = 1 << 22
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MANIFEST_FILENAME = "manifest.json"
FORMAT = "megatron_core training checkpoint"
VERSION = 2


def checkpoint_layout() -> dict[str, Any]:
    """This run's layout as a checkpoint records it: world size, tp/pp/dp sizes, device type."""
    return {
        "world_size": dist.get_world_size(),
        "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp_size": parallel_state.get_data_parallel_world_size(),
        "device_type": device.device_type(),
    }


class ShardSavePlanner(DefaultSavePlanner):
    """Writes each :class:`Shard` as a DCP chunk at its offsets in its global shape.

    Args:
        shards: the state to save, global name -> Shard.
    """

    def __init__(self, shards: dict[str, Shard]):
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True
        )
        self.shards = shards

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, shard in self.shards.items():
            offsets = torch.Size(shard.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(name, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=shard.tensor.size()),
                        properties=TensorProperties.create_from_tensor(shard.tensor),
                        size=torch.Size(shard.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.shards[write_item.index.fqn].tensor.detach().contiguous()


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads, for each :class:`Shard`, the overlap of every saved chunk with its cut.

    The caller has checked that every name is in the checkpoint with the same global shape
    (``checkpoint._check_metadata``). Byte objects are refused: a checkpoint of ours holds only
    tensors, so nothing is ever unpickled by ``torch.load(weights_only=False)``.
    """

    def __init__(self, shards: dict[str, Shard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for name, shard in self.shards.items():
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(shard.offsets), sizes=shard.tensor.size()
            )
            stored = self.metadata.state_dict_metadata[name]
            requests += create_read_items_for_chunk_list(name, stored, [chunk])
        return LoadPlan(requests)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise MegatronCoreError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; megatron_core "
            "checkpoints hold tensors only, and pickles are never loaded"
        )

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.shards[index.fqn].tensor


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only the classes it is made of (no code runs)."""

    _MODULES = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    )
    _BUILTINS = {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # "torch.strided" -> torch.strided
        ("pathlib", "PosixPath"),  # the checkpoint id
        ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str):
        if module in self._MODULES or (module, name) in self._BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def unreadable(path: Path, exc: BaseException) -> MegatronCoreError:
    """The error for a checkpoint file that cannot be parsed, on one line (parsers' messages may
    span several: pickle's persistent-id error does)."""
    text = " ".join(str(exc).split())
    return MegatronCoreError(f"{path} is unreadable ({type(exc).__name__}: {text})")


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata file ``path`` (``.metadata``), unpickled safely.

    Raises:
        MegatronCoreError: unreadable, or it names anything but DCP's metadata classes.
    """
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except Exception as exc:
        raise unreadable(path, exc) from None
    if not isinstance(metadata, Metadata):
        raise MegatronCoreError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with :func:`read_metadata` instead of a plain ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path) / ".metadata")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _os_error_in(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``'s chain (``__cause__`` / ``__context__``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class OSErrorFileSystemWriter(FileSystemWriter):
    """DCP's FileSystemWriter whose failed writes name the OS error, e.g. "No space left on
    device", on the rank that hit it.

    ``torch.save`` (DCP writes each tensor with it) reports a failed write as ``unexpected pos
    704 vs 598`` and keeps the OSError only as ``__context__``, which DCP drops when it gathers
    the ranks' failures; so the OSError is raised here instead, before DCP sees the failure.
    """

    def _named(self, exc: Exception) -> Exception:
        found = _os_error_in(exc)
        if found is None and "unexpected pos" in str(exc):
            try:  # no OSError kept: a full disk is the usual cause of a short write
                full = os.statvfs(self.path).f_bavail == 0
            except (OSError, AttributeError):
                full = False
            found = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else None
        if found is None or found is exc:
            return exc
        return OSError(found.errno, found.strerror, str(found.filename or self.path))

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as exc:
            raise self._named(exc) from exc

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as exc:
            raise self._named(exc) from exc


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def all_gather_text(text: str) -> list[str]:
    """Every rank's ``text`` (UTF-8), indexed by global rank: two all-gathers over WORLD."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    where = device.current_device()
    size = torch.tensor([data.numel()], dtype=torch.int64, device=where)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=where)
    padded[: data.numel()] = data.to(where)
    rows = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(rows, padded)
    return [
        bytes(row[: int(s.item())].cpu().tolist()).decode(errors="replace")
        for row, s in zip(rows, sizes)
    ]


def agree(message: str | None, what: str) -> None:
    """Share every rank's error message; if any rank failed, raise on every rank.

    The error is one line when every failing rank reports the same message, else it names the
    ranks: ``<what> failed: <message>`` or ``<what> failed on rank(s) [1]: <message>``.

    Raises:
        MegatronCoreError: on every rank, if any rank passed a message.
    """
    texts = all_gather_text(message or "")
    errors = {rank: text for rank, text in enumerate(texts) if text}
    if not errors:
        return
    distinct = sorted(set(errors.values()), key=list(errors.values()).index)
    if len(distinct) == 1 and len(errors) == len(texts):
        raise MegatronCoreError(f"{what} failed: {distinct[0]}")
    parts = [f"rank(s) {[r for r, t in errors.items() if t == text]}: {text}" for text in distinct]
    raise MegatronCoreError(f"{what} failed on {'; '.join(parts)}")
