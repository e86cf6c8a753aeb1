"""The main job's checkpoints: save at --save-interval, resume from --load, and what a changed
flag means there (a model flag refuses the checkpoint, a schedule flag warns). The format and
its rules are checkpoint.py's (NOTE [ Checkpoint safety ])."""

from __future__ import annotations

import argparse
import random
import warnings

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_core.training.checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from megatron_core.training.pipeline_step import reseed_stage

__all__ = ["resume", "save", "schedule_changes"]


# Flags whose change at --load alters training from the checkpoint on (warned), and flags that
# must match for the checkpoint's tensors to mean anything (refused).
_SCHEDULE_FLAGS = (
    "train_iters",
    "lr",
    "min_lr",
    "lr_warmup_iters",
    "global_batch_size",
    "seed",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "clip_grad",
)
_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _resolved_model_flags(values) -> dict:
    """The model flags as the model is built from them: ``ffn_hidden_size`` None means 4·h."""
    resolved = {k: values.get(k) for k in _MODEL_FLAGS}
    if resolved["ffn_hidden_size"] is None and resolved["hidden_size"] is not None:
        resolved["ffn_hidden_size"] = 4 * resolved["hidden_size"]
    return resolved


def _check_model_args(args):
    def check(saved: dict) -> None:
        ours, theirs = _resolved_model_flags(vars(args)), _resolved_model_flags(saved)
        wrong = [
            f"{_flag(k)} {theirs[k]} (this run: {ours[k]})"
            for k in _MODEL_FLAGS
            if k in saved and theirs[k] != ours[k]
        ]
        if wrong:
            raise MegatronCoreError(f"the checkpoint was trained with {', '.join(wrong)}")

    return check


def schedule_changes(saved: dict, args: argparse.Namespace) -> list[str]:
    """One line per schedule flag whose value differs from the checkpoint's run."""
    return [
        f"{_flag(k)} is {getattr(args, k)}, the checkpoint was trained with {saved[k]}: "
        "training from the checkpoint on differs from the uninterrupted run"
        for k in _SCHEDULE_FLAGS
        if k in saved and saved[k] != getattr(args, k)
    ]


def save(args, iteration, model, optimizer, progress) -> None:
    """Save the main job's checkpoint of ``iteration`` under ``--save`` (every rank)."""
    plain = {
        k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))
    }
    path = save_checkpoint(args.save, iteration, model, optimizer, plain)
    progress.print(f"saved checkpoint {path}")


def resume(args, model, optimizer) -> tuple[int, list[str]]:
    """Load --load; returns (iteration, lines to print). See NOTE [ Checkpoint safety ], rule 4
    in checkpoint.py: at another layout the RNG streams restart from (seed + iteration)."""
    loaded: LoadedCheckpoint = load_checkpoint(
        args.load,
        model,
        optimizer,
        check_args=_check_model_args(args),
        iteration=getattr(args, "ckpt_step", None),
    )
    start, saved = loaded.iteration, loaded.layout
    lines = [f"resumed from {args.load} at iteration {start}"]
    if not loaded.rng_restored:
        seed = args.seed + start
        random.seed(seed)
        model_parallel_cuda_manual_seed(seed)
        if args.pipeline_model_parallel_size > 1:
            reseed_stage(seed)
        lines[0] += (
            f" (saved at tp={saved['tp_size']} pp={saved['pp_size']} dp={saved['dp_size']} on "
            f"{saved['device_type']}, resharded; RNG streams re-derived from --seed + {start})"
        )
    if dist.get_rank() == 0:
        for line in schedule_changes(loaded.args, args):
            warnings.warn(line, UserWarning, stacklevel=2)
    return start, lines
