"""Save and load training checkpoints: model shards, optimizer state and every rank's RNG state.

Layout of ``--save DIR`` (megatron's names for the directory and the tracker file)::

    DIR/latest_checkpointed_iteration.txt     the iteration of the newest complete checkpoint
    DIR/iter_0000100/mp_rank_00_000.pt        TP rank 00, PP rank 000: model shard + optimizer
    DIR/iter_0000100/rng_rank_00001.pt        global rank 1: its RNG state dict

# NOTE [ Checkpoint files ]
1. Who writes what. Data-parallel rank 0 of each (TP, PP) position writes the model shard and
   optimizer state (the DP replicas hold the same values); every rank writes its own RNG state
   (``tensor_parallel.get_rng_state_dict``: python, CPU, device and tracker streams), so a
   resumed run draws exactly what the uninterrupted run would have drawn.
2. Atomic. Each file is written to a temporary name and renamed; the tracker file is written by
   rank 0 last, only after every rank reported its files written. A crash mid-save leaves the
   previous checkpoint as the latest one.
3. Load validates before it touches anything. Every rank reads the tracker, reads its files and
   checks version, iteration, parallel layout (tp/pp/dp sizes and ranks, world size), parameter
   names and shapes, and optimizer structure. Then all ranks exchange their error messages (one
   all-gather) and either every rank loads or every rank raises the same error, naming the
   failing ranks: no rank hangs, no rank is half-loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.rng_state import get_rng_state_dict, set_rng_state_dict

__all__ = ["TRACKER_FILENAME", "save_checkpoint", "load_checkpoint", "checkpoint_files"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_VERSION = 1
_MESSAGE_BYTES = 1024


def _layout() -> dict[str, int]:
    return {
        "world_size": dist.get_world_size(),
        "global_rank": dist.get_rank(),
        "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp_size": parallel_state.get_data_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
    }


def checkpoint_files(root: str | os.PathLike, iteration: int) -> tuple[Path, Path]:
    """(model/optimizer file, RNG file) of this rank for ``iteration`` under ``root``."""
    layout = _layout()
    directory = Path(root) / f"iter_{iteration:07d}"
    model_file = directory / f"mp_rank_{layout['tp_rank']:02d}_{layout['pp_rank']:03d}.pt"
    return model_file, directory / f"rng_rank_{layout['global_rank']:05d}.pt"


def _agree(message: str | None, what: str) -> None:
    """Share every rank's error message (one all-reduce); raise on all ranks if any failed."""
    encoded = (message or "").encode()[:_MESSAGE_BYTES]
    rows = torch.zeros(
        dist.get_world_size(), _MESSAGE_BYTES, dtype=torch.int32, device=device.current_device()
    )
    if encoded:  # each rank fills its own row: the sum over ranks is the gather of the rows
        rows[dist.get_rank(), : len(encoded)] = torch.tensor(list(encoded), dtype=torch.int32)
    dist.all_reduce(rows)
    texts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows.cpu().tolist()]
    errors = {rank: text for rank, text in enumerate(texts) if text}
    if errors:
        lines = "\n".join(f"  rank {r}: {text}" for r, text in sorted(errors.items()))
        raise MegatronCoreError(f"{what} failed on rank(s) {sorted(errors)}:\n{lines}")


def _write(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # See NOTE [ Checkpoint files ], rule 2


def save_checkpoint(root, iteration: int, model, optimizer, args: dict[str, Any]) -> Path:
    """Write this rank's part of the checkpoint of ``iteration``; call on every rank.

    Args:
        root: the --save directory.
        iteration: iterations completed.
        model: the model (this rank's shard).
        optimizer: its optimizer.
        args: the run's arguments (plain values), stored for reference.

    Returns:
        The iteration directory.

    Raises:
        MegatronCoreError: on every rank, if any rank could not write its files.
    """
    model_file, rng_file = checkpoint_files(root, iteration)
    layout = _layout()
    header = {"version": _VERSION, "iteration": iteration, "layout": layout}
    error = None
    try:
        if layout["dp_rank"] == 0:  # See NOTE [ Checkpoint files ], rule 1
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            _write({**header, **state, "args": args}, model_file)
        _write({**header, "rng": get_rng_state_dict()}, rng_file)
    except Exception as exc:  # reported to every rank by _agree
        error = f"writing {model_file.parent}: {type(exc).__name__}: {exc}"
    _agree(error, f"saving checkpoint {model_file.parent}")
    if dist.get_rank() == 0:
        try:
            tmp = Path(root) / f".{TRACKER_FILENAME}.tmp"
            tmp.write_text(f"{iteration}\n")
            os.replace(tmp, Path(root) / TRACKER_FILENAME)
        except OSError as exc:
            error = f"writing {TRACKER_FILENAME}: {exc}"
    _agree(error, f"saving checkpoint {model_file.parent}")
    return model_file.parent


def _read_iteration(root: Path) -> int:
    tracker = root / TRACKER_FILENAME
    if not tracker.is_file():
        raise MegatronCoreError(f"no checkpoint in {root}: {tracker} does not exist")
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise MegatronCoreError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


def _read(path: Path, iteration: int) -> dict[str, Any]:
    if not path.is_file():
        raise MegatronCoreError(f"{path} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise MegatronCoreError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("version") != _VERSION:
        raise MegatronCoreError(f"{path} is not a version-{_VERSION} megatron_core checkpoint")
    if state.get("iteration") != iteration:
        raise MegatronCoreError(f"{path} is of iteration {state.get('iteration')}, not {iteration}")
    return state


def _check_layout(path: Path, saved: dict[str, int], keys: tuple[str, ...]) -> None:
    now = _layout()
    names = {
        "tp_size": "tensor_model_parallel_size",
        "pp_size": "pipeline_model_parallel_size",
        "dp_size": "data_parallel_size",
    }
    wrong = [
        f"{names.get(k, k)} {saved.get(k)} (this run: {now[k]})"
        for k in keys
        if saved.get(k) != now[k]
    ]
    if wrong:
        raise MegatronCoreError(f"{path} was saved with {', '.join(wrong)}")


def _check_model(path: Path, saved: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    own = model.state_dict()
    if set(saved) != set(own):
        missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        raise MegatronCoreError(f"{path}: parameters missing {missing}, unexpected {extra}")
    for name, tensor in own.items():
        if not torch.is_tensor(tensor):  # e.g. a layer's _extra_state (None, as in megatron-core)
            continue
        if saved[name].shape != tensor.shape or saved[name].dtype != tensor.dtype:
            raise MegatronCoreError(
                f"{path}: {name} is {saved[name].dtype} {list(saved[name].shape)}, the model "
                f"has {tensor.dtype} {list(tensor.shape)} (another model configuration?)"
            )


def _check_optimizer(path: Path, saved: dict[str, Any], optimizer) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise MegatronCoreError(f"{path}: optimizer parameter groups {sizes} do not match")
    for index, state in saved.get("state", {}).items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() and value.shape != params[index].shape:
                raise MegatronCoreError(
                    f"{path}: optimizer state {key!r} of parameter {index} has shape "
                    f"{list(value.shape)}, the parameter {list(params[index].shape)}"
                )


def _read_and_check(root: Path, model, optimizer):
    iteration = _read_iteration(root)
    model_file, rng_file = checkpoint_files(root, iteration)
    state = _read(model_file, iteration)
    _check_layout(model_file, state["layout"], ("tp_size", "pp_size", "tp_rank", "pp_rank"))
    _check_model(model_file, state["model"], model)
    _check_optimizer(model_file, state["optimizer"], optimizer)
    rng = _read(rng_file, iteration)
    _check_layout(rng_file, rng["layout"], tuple(_layout()))
    return iteration, state, rng


def load_checkpoint(root, model, optimizer) -> tuple[int, dict[str, Any]]:
    """Load the latest checkpoint under ``root`` into ``model``, ``optimizer`` and the RNGs.

    Call on every rank. See NOTE [ Checkpoint files ], rule 3: everything is validated on every
    rank first, and nothing is loaded unless every rank's checks passed.

    Returns:
        (iteration, the saved args).

    Raises:
        MegatronCoreError: on every rank, naming each failing rank and why (no checkpoint, a
            missing or corrupt file, another parallel layout or model shape).
    """
    root = Path(root)
    error, loaded = None, None
    try:
        loaded = _read_and_check(root, model, optimizer)
    except MegatronCoreError as exc:
        error = str(exc)
    except Exception as exc:  # e.g. a malformed file: still reported to every rank
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, f"loading checkpoint from {root}")
    iteration, state, rng = loaded
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state_dict(rng["rng"])
    return iteration, state.get("args", {})
