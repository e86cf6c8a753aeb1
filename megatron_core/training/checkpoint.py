"""Save and load training checkpoints with torch.distributed.checkpoint (DCP), at any layout.

Layout of ``--save DIR`` (megatron's names for the iteration directories and the tracker)::

    DIR/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    DIR/iter_0000100/.metadata              DCP: every tensor's global shape and saved chunks
    DIR/iter_0000100/__0_0.distcp ...       DCP: the chunks, one file per writing rank
    DIR/iter_0000100/manifest.json          iteration, layout, args, RNG info, file checksums

What is saved, under which names and cut how: NOTE [ Checkpoint keys ] in checkpoint_state.py.

# NOTE [ Checkpoint safety ]
1. Never visible half-written. A save writes into the hidden ``DIR/.iter_<N>.partial`` (stale
   ones from killed saves are removed first); DCP fsyncs every file; then rank 0 writes
   manifest.json with every file's size and SHA-256, fsyncs, renames the directory to
   ``iter_<N>`` (an older ``iter_<N>``, of any layout, is swapped out whole, never mixed with),
   fsyncs DIR, and only then replaces the tracker file (write, fsync, rename). A save killed at
   any point leaves the previous checkpoint as the latest, loadable one.
2. Never loaded damaged. Load reads the tracker and the manifest, checks every file's size on
   every rank and its SHA-256 on one rank each (files dealt round-robin), then reads DCP's
   metadata with an unpickler that allows only DCP's metadata classes, and checks that every
   tensor this run needs is there with the same global shape. Only then are the tensors read,
   into fresh buffers, and copied into the parameters, optimizer and RNGs.
3. Every rank fails alike. Each step's errors are exchanged (``checkpoint_io.agree``) before the
   next collective: every rank raises the same MegatronCoreError naming the file or tensor,
   and nothing has been modified.
4. Resharding. Tensors are stored by global name and cut (DCP chunks), so a checkpoint saved at
   TP=a x DP=b loads at TP=c x DP=d, sequence parallelism on or off. Per-rank RNG states are
   restored only at the same layout and device type; otherwise the caller re-derives them
   (``LoadedCheckpoint.rng_restored`` is False).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.rng_state import set_rng_state_dict
from megatron_core.training import checkpoint_state as state
from megatron_core.training.checkpoint_io import (
    SafeFileSystemReader,
    ShardLoadPlanner,
    ShardSavePlanner,
    agree,
    all_gather_text,
    fsync_path,
    read_metadata,
    sha256_of,
)

__all__ = [
    "TRACKER_FILENAME",
    "MANIFEST_FILENAME",
    "LoadedCheckpoint",
    "checkpoint_layout",
    "save_checkpoint",
    "load_checkpoint",
]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MANIFEST_FILENAME = "manifest.json"
_FORMAT = "megatron_core training checkpoint"
_VERSION = 2


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` found.

    Attributes:
        iteration: iterations completed when it was saved.
        args: the saving run's arguments (plain values).
        layout: its parallel layout (``checkpoint_layout()`` of the saving run).
        rng_restored: True if every rank's RNG state was restored (same layout and device).
    """

    iteration: int
    args: dict[str, Any]
    layout: dict[str, Any]
    rng_restored: bool


def checkpoint_layout() -> dict[str, Any]:
    """This run's layout as a checkpoint records it: world size, tp/pp/dp sizes, device type."""
    from megatron_core import device

    return {
        "world_size": dist.get_world_size(),
        "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp_size": parallel_state.get_data_parallel_world_size(),
        "device_type": device.device_type(),
    }


def _iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):  # DCP: {rank: (exception, traceback)}
        failures = exc.failures
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {_error_text(inner)}")
        return "; ".join(parts)
    if isinstance(exc, MegatronCoreError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _guard(step: Callable[[], Any], what: str) -> Any:
    """Run ``step``; agree on its error across ranks (NOTE [ Checkpoint safety ], rule 3)."""
    result, error = None, None
    try:
        result = step()
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        error = _error_text(exc)
    agree(error, what)
    return result


# --- save ----------------------------------------------------------------------------------


def _prepare_directory(partial: Path) -> None:
    if dist.get_rank() == 0:
        partial.parent.mkdir(parents=True, exist_ok=True)
        for stale in (
            *partial.parent.glob(".iter_*.partial"),
            *partial.parent.glob(".iter_*.replaced"),
        ):
            shutil.rmtree(stale)  # a killed save's leftovers (one job per directory)
        partial.mkdir()


def _write_manifest(partial: Path, manifest: dict[str, Any], files: dict[str, Any]) -> None:
    files[".metadata"] = {
        "bytes": (partial / ".metadata").stat().st_size,
        "sha256": sha256_of(partial / ".metadata"),
    }
    manifest["files"] = dict(sorted(files.items()))
    path = partial / MANIFEST_FILENAME
    with open(path, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    fsync_path(partial)


def _publish(root: Path, partial: Path, final: Path, iteration: int) -> None:
    """Rank 0: the renames of NOTE [ Checkpoint safety ], rule 1."""
    replaced = root / f".{final.name}.replaced"
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    os.replace(partial, final)
    fsync_path(root)
    tracker_tmp = root / f".{TRACKER_FILENAME}.tmp"
    with open(tracker_tmp, "w") as file:
        file.write(f"{iteration}\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(tracker_tmp, root / TRACKER_FILENAME)
    fsync_path(root)
    if replaced.exists():
        shutil.rmtree(replaced)


def save_checkpoint(root, iteration: int, model, optimizer, args: dict[str, Any]) -> Path:
    """Save ``iteration``'s model, optimizer and RNG state under ``root``; call on every rank.

    Tensors go through DCP: each distinct shard is written once (NOTE [ Checkpoint keys ] in
    checkpoint_state.py); the directory becomes visible atomically (NOTE [ Checkpoint safety ]).

    Args:
        root: the --save directory.
        iteration: iterations completed.
        model: this rank's model (its tensor-parallel shards; layer keys made global with
            ``model.layer_offset`` if set).
        optimizer: its optimizer (torch.optim, or a wrapper with the hooks of NOTE
            [ Checkpoint keys ], rule 4).
        args: the run's arguments (JSON-able values), stored in the manifest.

    Returns:
        The iteration directory.

    Raises:
        MegatronCoreError: on every rank, if any rank failed (the message names the rank and
            the OS error, e.g. "No space left on device"); no temporary files remain.
    """
    root = Path(root)
    final = _iteration_dir(root, iteration)
    partial = root / f".{final.name}.partial"
    what = f"saving checkpoint {final}"
    rank = dist.get_rank()

    def collect():
        shards = {name: shard for name, (shard, _) in state.model_entries(model).items()}
        shards.update(state.optimizer_entries(model, optimizer))
        rng, rng_meta = state.rng_entries(rank)
        shards.update(rng)
        return shards, rng_meta

    shards, rng_meta = _guard(collect, what)
    try:
        _guard(lambda: _prepare_directory(partial), what)
        _guard(lambda: _write_shards(partial, shards), what)
        own = _guard(lambda: _own_files(partial, rank), what)
        gathered = all_gather_text(json.dumps({"files": own, "rng": rng_meta}))

        def finish():
            if rank != 0:
                return
            files, rng = {}, {}
            for r, text in enumerate(gathered):
                part = json.loads(text)
                files.update(part["files"])
                rng[str(r)] = part["rng"]
            manifest = {
                "format": _FORMAT,
                "version": _VERSION,
                "iteration": iteration,
                "layout": checkpoint_layout(),
                "args": args,
                "rng": rng,
            }
            _write_manifest(partial, manifest, files)
            _publish(root, partial, final, iteration)

        _guard(finish, what)
    except MegatronCoreError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            (root / f".{TRACKER_FILENAME}.tmp").unlink(missing_ok=True)
        raise
    return final


def _write_shards(partial: Path, shards: dict[str, state.Shard]) -> None:
    writer = FileSystemWriter(partial, single_file_per_rank=True, sync_files=True)
    tensors = {name: shard.tensor for name, shard in shards.items()}
    dcp.save(tensors, storage_writer=writer, planner=ShardSavePlanner(shards))


def _own_files(partial: Path, rank: int) -> dict[str, Any]:
    """Size and SHA-256 of the DCP files this rank wrote (``__<rank>_*.distcp``)."""
    return {
        path.name: {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        for path in sorted(partial.glob(f"__{rank}_*.distcp"))
    }


# --- load ----------------------------------------------------------------------------------


def _read_iteration(root: Path) -> int:
    tracker = root / TRACKER_FILENAME
    if not tracker.is_file():
        raise MegatronCoreError(f"no checkpoint in {root}: {tracker} does not exist")
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise MegatronCoreError(f"{tracker} holds {text[:40]!r}, not an iteration number")
    return int(text)


def _read_manifest(directory: Path, iteration: int) -> dict[str, Any]:
    path = directory / MANIFEST_FILENAME
    if not directory.is_dir():
        raise MegatronCoreError(
            f"{directory} is missing (the tracker file names iteration {iteration})"
        )
    if not path.is_file():
        raise MegatronCoreError(f"{path} is missing: not a complete megatron_core checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MegatronCoreError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise MegatronCoreError(f"{path} is not a megatron_core checkpoint manifest")
    if manifest.get("version") != _VERSION:
        raise MegatronCoreError(
            f"{path} is version {manifest.get('version')!r}; this megatron_core reads "
            f"version {_VERSION}"
        )
    if manifest.get("iteration") != iteration:
        raise MegatronCoreError(
            f"{path} is of iteration {manifest.get('iteration')}, the tracker says {iteration}"
        )
    return manifest


def _verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    """NOTE [ Checkpoint safety ], rule 2: sizes everywhere, checksums dealt round-robin."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for index, (name, expected) in enumerate(sorted(manifest["files"].items())):
        path = directory / name
        if not path.is_file():
            raise MegatronCoreError(f"{path} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise MegatronCoreError(
                f"{path} is {size} bytes, the manifest says {expected['bytes']} (truncated or "
                "overwritten)"
            )
        if index % world == rank and sha256_of(path) != expected["sha256"]:
            raise MegatronCoreError(f"{path} is corrupt: its SHA-256 does not match the manifest")


def _buffer_for(shard: state.Shard, target: torch.Tensor) -> state.Shard:
    return state.Shard(
        torch.zeros_like(shard.tensor), shard.global_shape, shard.offsets, target=target
    )


def _optimizer_targets(model, optimizer, metadata, plan: dict[str, state.Shard], later: list):
    """Buffers for the optimizer's tensors; ``later`` gets (name, optimizer_param, key, full
    tensor) to install once loaded."""
    saved = metadata.state_dict_metadata
    for name, model_param, optimizer_param in state.optimizer_pairs(model, optimizer):
        if optimizer_param is not model_param:
            master = f"optimizer.master.{name}"
            shard = state.cut(model_param, optimizer_param.detach())
            if master in saved and not shard.empty:
                plan[master] = _buffer_for(shard, shard.tensor)
            elif master not in saved:
                later.append(("master-from-model", optimizer_param, model_param, None))
        prefix = f"optimizer.{name}."
        for key in sorted(k for k in saved if k.startswith(prefix)):
            stored = saved[key]
            if not isinstance(stored, TensorStorageMetadata):
                raise MegatronCoreError(f"checkpoint entry {key!r} is not a tensor")
            dtype = stored.properties.dtype
            like = torch.zeros(model_param.shape, dtype=dtype, device=optimizer_param.device)
            shard = state.cut(model_param, like)
            if tuple(stored.size) != shard.global_shape:
                like = torch.zeros(stored.size, dtype=dtype)  # replicated (a step count)
                shard = state.Shard(like, tuple(stored.size), (0,) * len(stored.size))
            if not shard.empty:  # else all padding: zeros
                plan[key] = _buffer_for(shard, shard.tensor)
            later.append(("state", optimizer_param, key[len(prefix) :], like))
    extra = sorted(k for k in saved if k.startswith("optimizer.extra."))
    for key in extra:
        stored = saved[key]
        like = torch.zeros(stored.size, dtype=stored.properties.dtype)
        plan[key] = state.Shard(like, tuple(stored.size), (0,) * len(stored.size), target=like)
    if extra and getattr(optimizer, "load_checkpoint_extra_state", None) is None:
        raise MegatronCoreError(
            f"the checkpoint holds optimizer state {extra} that this optimizer has no "
            "load_checkpoint_extra_state() for"
        )


def _plan_load(model, optimizer, metadata, manifest: dict[str, Any]):
    """Buffers for everything this rank loads, checked against the metadata (rule 2)."""
    plan: dict[str, state.Shard] = {}
    for name, (shard, _) in state.model_entries(model).items():
        plan[name] = _buffer_for(shard, shard.tensor)
    later: list = []
    _optimizer_targets(model, optimizer, metadata, plan, later)
    saved = metadata.state_dict_metadata
    same_layout = manifest["layout"] == checkpoint_layout()
    rng_keys = []
    if same_layout:
        prefix = f"rng.{dist.get_rank()}."
        for key in sorted(k for k in saved if k.startswith(prefix)):
            stored = saved[key]
            like = torch.zeros(stored.size, dtype=stored.properties.dtype)
            plan[key] = state.Shard(like, tuple(stored.size), (0,) * len(stored.size), target=like)
            rng_keys.append(key)
    for name, shard in plan.items():
        stored = saved.get(name)
        if stored is None:
            raise MegatronCoreError(
                f"the checkpoint has no {name!r} (saved by another model configuration?)"
            )
        if tuple(stored.size) != shard.global_shape:
            raise MegatronCoreError(
                f"{name} is {list(stored.size)} in the checkpoint, {list(shard.global_shape)} "
                "in this model (another model configuration?)"
            )
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        ours = state.model_names(model)
        extra = sorted(k for k in saved if k.startswith("model.") and k not in ours)
        if extra:
            raise MegatronCoreError(
                f"the checkpoint has model tensors this model lacks: {extra[:3]} (another model "
                "configuration?)"
            )
    return plan, later, rng_keys


def _apply(plan, later, rng_keys, optimizer, manifest) -> bool:
    """Copy the loaded buffers into the live tensors; returns whether the RNGs were restored."""
    with torch.no_grad():
        for shard in plan.values():
            if shard.target is not None and shard.target is not shard.tensor:
                shard.target.copy_(shard.tensor)
        inner_state = getattr(optimizer, "optimizer", optimizer).state
        for kind, optimizer_param, key, value in later:
            if kind == "master-from-model":
                optimizer_param.copy_(key)
            else:
                inner_state.setdefault(optimizer_param, {})[key] = value
    extra = {
        key[len("optimizer.extra.") :]: shard.tensor
        for key, shard in plan.items()
        if key.startswith("optimizer.extra.")
    }
    if extra:
        optimizer.load_checkpoint_extra_state(extra)
    if not rng_keys:
        return False
    meta = manifest["rng"][str(dist.get_rank())]
    prefix = f"rng.{dist.get_rank()}."
    python = tuple(int(v) for v in plan[prefix + "python"].tensor.tolist())
    set_rng_state_dict(
        {
            "version": meta["version"],
            "layout": meta["layout"],
            "device_type": meta["device_type"],
            "python": (meta["python_version"], python, meta["python_gauss"]),
            "cpu": plan[prefix + "cpu"].tensor,
            "device": plan[prefix + "device"].tensor,
            "tracker": {n: plan[f"{prefix}tracker.{n}"].tensor for n in meta["trackers"]},
        }
    )
    return True


def load_checkpoint(
    root, model, optimizer, check_args: Callable[[dict[str, Any]], None] | None = None
) -> LoadedCheckpoint:
    """Load the latest checkpoint under ``root`` into ``model``, ``optimizer`` and the RNGs.

    Call on every rank. The checkpoint may come from any TP/DP layout (resharding, NOTE
    [ Checkpoint safety ], rule 4). Everything is verified first and nothing is modified unless
    every rank's checks passed (rules 2, 3).

    Args:
        root: the --load directory.
        model: this rank's model, built for this run's layout.
        optimizer: its optimizer (see NOTE [ Checkpoint keys ], rule 4).
        check_args: called with the saving run's arguments before anything is read; raise
            MegatronCoreError to refuse the checkpoint (an incompatible model configuration).

    Returns:
        A :class:`LoadedCheckpoint`.

    Raises:
        MegatronCoreError: on every rank, naming the file or tensor: no checkpoint, a missing,
            truncated, corrupt or unreadable file, another model configuration.
    """
    root = Path(root)
    what = f"loading checkpoint from {root}"

    def find():
        iteration = _read_iteration(root)
        directory = _iteration_dir(root, iteration)
        manifest = _read_manifest(directory, iteration)
        if check_args is not None:
            check_args(manifest.get("args", {}))
        _verify_files(directory, manifest)
        return directory, manifest

    directory, manifest = _guard(find, what)

    def plan_load():
        metadata = read_metadata(directory / ".metadata")
        return _plan_load(model, optimizer, metadata, manifest)

    plan, later, rng_keys = _guard(plan_load, what)

    def read():
        tensors = {name: shard.tensor for name, shard in plan.items()}
        dcp.load(
            tensors, storage_reader=SafeFileSystemReader(directory), planner=ShardLoadPlanner(plan)
        )

    _guard(read, what)
    rng_restored = _apply(plan, later, rng_keys, optimizer, manifest)
    return LoadedCheckpoint(
        iteration=manifest["iteration"],
        args=manifest.get("args", {}),
        layout=manifest["layout"],
        rng_restored=rng_restored,
    )
