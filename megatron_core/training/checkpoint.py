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
2. Never loaded damaged, nothing read unverified. Load reads the tracker (or the iteration
   asked for, ``--ckpt-step``) and the manifest; refuses any file in the directory that the
   manifest does not list; checks every listed file's size on every rank and its SHA-256 on one
   rank each (files dealt round-robin); reads DCP's metadata with an unpickler that allows only
   DCP's metadata classes; refuses a storage file it names that the manifest does not cover; and
   checks that every tensor this run needs is there with the same global shape. Only then are
   the tensors read, into fresh buffers, and copied into the parameters, optimizer and RNGs.
   Without a tracker, the error names the newest complete iteration directory and the flag.
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

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_core.errors import MegatronCoreError
from megatron_core.training import checkpoint_load as load
from megatron_core.training import checkpoint_state as state
from megatron_core.training.checkpoint_io import (
    FORMAT,
    MANIFEST_FILENAME,
    TRACKER_FILENAME,
    VERSION,
    OSErrorFileSystemWriter,
    SafeFileSystemReader,
    ShardLoadPlanner,
    ShardSavePlanner,
    agree,
    all_gather_text,
    checkpoint_layout,
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
        for stale in partial.parent.glob(".iter_*.partial"):
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
                "format": FORMAT,
                "version": VERSION,
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
    writer = OSErrorFileSystemWriter(partial, single_file_per_rank=True, sync_files=True)
    tensors = {name: shard.tensor for name, shard in shards.items()}
    dcp.save(tensors, storage_writer=writer, planner=ShardSavePlanner(shards))


def _own_files(partial: Path, rank: int) -> dict[str, Any]:
    """Size and SHA-256 of the DCP files this rank wrote (``__<rank>_*.distcp``)."""
    return {
        path.name: {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        for path in sorted(partial.glob(f"__{rank}_*.distcp"))
    }


# --- load ----------------------------------------------------------------------------------


def load_checkpoint(
    root,
    model,
    optimizer,
    check_args: Callable[[dict[str, Any]], None] | None = None,
    iteration: int | None = None,
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
        iteration: load this iteration's directory instead of the one the tracker file names
            (``--ckpt-step``; e.g. a complete checkpoint whose save stopped before the tracker).

    Returns:
        A :class:`LoadedCheckpoint`.

    Raises:
        MegatronCoreError: on every rank, naming the file or tensor: no checkpoint, a missing,
            truncated, corrupt, unreadable or unlisted file, another model configuration.
    """
    root = Path(root)
    what = f"loading checkpoint from {root}"

    def find():
        step = load.read_iteration(root, iteration)
        directory = _iteration_dir(root, step)
        named_by = "the tracker file" if iteration is None else "the requested iteration"
        manifest = load.read_manifest(directory, step, named_by)
        if check_args is not None:
            check_args(manifest.get("args", {}))
        load.verify_files(directory, manifest)
        return directory, manifest

    directory, manifest = _guard(find, what)

    def plan_load():
        metadata = read_metadata(directory / ".metadata")
        load.check_storage_files(directory, metadata, manifest)
        return load.plan_load(model, optimizer, metadata, manifest)

    plan, later, rng_keys = _guard(plan_load, what)

    def read():
        tensors = {name: shard.tensor for name, shard in plan.items()}
        dcp.load(
            tensors, storage_reader=SafeFileSystemReader(directory), planner=ShardLoadPlanner(plan)
        )

    _guard(read, what)
    try:  # no collective from here on: an error is the same on every rank
        rng_restored = load.apply_loaded(plan, later, rng_keys, optimizer, manifest)
    except MegatronCoreError as exc:
        raise MegatronCoreError(f"{what} failed: {exc}") from None
    return LoadedCheckpoint(
        iteration=manifest["iteration"],
        args=manifest.get("args", {}),
        layout=manifest["layout"],
        rng_restored=rng_restored,
    )
