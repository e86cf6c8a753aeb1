"""Loading half of training checkpoints: find, verify, plan and apply (NOTE [ Checkpoint safety ]
in checkpoint.py, rules 2-4). ``checkpoint.load_checkpoint`` runs these steps, agreeing on each
step's errors across ranks before the next.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.rng.state import set_rng_state_dict
from megatron_core.training import checkpoint_state as state
from megatron_core.training.checkpoint_io import (
    FORMAT,
    MANIFEST_FILENAME,
    TRACKER_FILENAME,
    VERSION,
    checkpoint_layout,
    sha256_of,
    unreadable,
)

__all__ = [
    "read_iteration",
    "read_manifest",
    "verify_files",
    "check_storage_files",
    "plan_load",
    "apply_loaded",
]


def read_iteration(root: Path, iteration: int | None = None) -> int:
    """The iteration to load: ``iteration`` if given (``--ckpt-step``), else the tracker's.

    Raises:
        MegatronCoreError: no tracker (naming the newest complete iteration directory that no
            tracker registers, if any, and the flag that loads it), or an unreadable tracker.
    """
    if iteration is not None:
        return iteration
    tracker = root / TRACKER_FILENAME
    if not tracker.is_file():
        raise MegatronCoreError(
            f"no checkpoint in {root}: {tracker} does not exist{_unregistered_hint(root)}"
        )
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise MegatronCoreError(f"{tracker} holds {text[:40]!r}, not an iteration number")
    return int(text)


def _unregistered_hint(root: Path) -> str:
    """Names the newest complete ``iter_N`` under ``root`` (a save killed after its rename but
    before the tracker, NOTE [ Checkpoint safety ], rule 1), or returns ""."""
    found = sorted(root.glob("iter_[0-9]*"), reverse=True) if root.is_dir() else []
    for directory in found:
        digits = directory.name[len("iter_") :]
        if not digits.isdigit():
            continue
        try:
            manifest = read_manifest(directory, int(digits))
            for name, expected in manifest["files"].items():
                if (directory / name).stat().st_size != expected["bytes"]:
                    raise MegatronCoreError(f"{name} is incomplete")
        except (MegatronCoreError, OSError, KeyError, TypeError):
            continue
        return (
            f"; {directory} is a complete checkpoint that no tracker registers (a save stopped "
            f"before writing the tracker): load it with --ckpt-step {int(digits)} "
            f"(load_checkpoint(..., iteration={int(digits)}))"
        )
    return ""


def read_manifest(
    directory: Path, iteration: int, named_by: str = "the tracker file"
) -> dict[str, Any]:
    """The manifest of ``directory`` (iteration ``iteration``, as ``named_by`` says), checked."""
    path = directory / MANIFEST_FILENAME
    if not directory.is_dir():
        replaced = directory.with_name(f".{directory.name}.replaced")
        hint = (
            f"; a save that replaced it was interrupted: {replaced} holds it"
            if replaced.is_dir()
            else ""
        )
        raise MegatronCoreError(
            f"{directory} is missing ({named_by} names iteration {iteration}){hint}"
        )
    if not path.is_file():
        raise MegatronCoreError(f"{path} is missing: not a complete megatron_core checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise unreadable(path, exc) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise MegatronCoreError(f"{path} is not a megatron_core checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise MegatronCoreError(
            f"{path} is version {manifest.get('version')!r}; this megatron_core reads "
            f"version {VERSION}"
        )
    if manifest.get("iteration") != iteration:
        raise MegatronCoreError(
            f"{path} is of iteration {manifest.get('iteration')}, {named_by} says {iteration}"
        )
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    """NOTE [ Checkpoint safety ], rule 2: every file in ``directory`` is listed; sizes are
    checked everywhere, checksums dealt round-robin."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise MegatronCoreError(f"{directory / MANIFEST_FILENAME} lists no files")
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if path.is_file() and name != MANIFEST_FILENAME and name not in listed:
            raise MegatronCoreError(
                f"{path} is not listed in {MANIFEST_FILENAME}, so it cannot be verified (its "
                "entry was removed, or the file was added after the save); refusing to load"
            )
    for index, (name, expected) in enumerate(sorted(listed.items())):
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


def check_storage_files(directory: Path, metadata, manifest: dict[str, Any]) -> None:
    """Every storage file that DCP's ``.metadata`` names is one the manifest lists (so it was
    verified by :func:`verify_files`): nothing unverified is ever read."""
    named = {
        getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()
    }
    for name in sorted(str(n) for n in named if n is not None):
        if name not in manifest["files"]:
            raise MegatronCoreError(
                f"{directory / name} is named by .metadata but not covered by "
                f"{MANIFEST_FILENAME}, so it cannot be verified; refusing to load"
            )


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


def plan_load(model, optimizer, metadata, manifest: dict[str, Any]):
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


def apply_loaded(plan, later, rng_keys, optimizer, manifest) -> bool:
    """Copy the loaded buffers into the live tensors; returns whether the RNGs were restored.

    The optimizer's ``load_checkpoint_extra_state`` runs first (with {} when the checkpoint has
    no extra state), so that an optimizer refusing the checkpoint (a loss scaler saved, none
    now) raises before anything else is modified; it is the same on every rank.
    """
    extra = {
        key[len("optimizer.extra.") :]: shard.tensor
        for key, shard in plan.items()
        if key.startswith("optimizer.extra.")
    }
    hook = getattr(optimizer, "load_checkpoint_extra_state", None)
    if hook is not None:
        hook(extra)
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
