"""Command-line arguments of scripts/train_gpt.py (megatron-LM's flag names where they exist).

:func:`parse_args` checks what needs no processes; :func:`validate_args` checks what depends on
the world size. Both raise :class:`~megatron_core.errors.MegatronCoreError` naming the values,
before any collective, so every rank fails the same way.
"""

from __future__ import annotations

import argparse
import os

from megatron_core.errors import MegatronCoreError
from megatron_core.training.data import DEFAULT_CORPUS_DESCRIPTION
from megatron_core.training.pipeline_step import check_pipeline_args, check_pipeline_microbatches

__all__ = ["build_parser", "parse_args", "validate_args", "data_parallel_size"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


_POS = {"type": _positive_int}
_FLOAT = {"type": float}
_FLAG = {"action": "store_true"}

# (group title, [(flag, default, kwargs, help), ...]); help strings show the defaults.
_ARGUMENTS = [
    (
        "model (a tiny byte-level GPT by default)",
        [
            ("--num-layers", 4, _POS, "transformer layers"),
            ("--hidden-size", 128, _POS, "model width"),
            ("--num-attention-heads", 4, _POS, "attention heads (a multiple of the TP size)"),
            ("--ffn-hidden-size", None, _POS, "MLP width (None: 4 * hidden size)"),
            ("--seq-length", 128, _POS, "tokens (bytes) per sample"),
            ("--hidden-dropout", 0.1, _FLOAT, "dropout after embeddings, attention and MLP"),
            ("--attention-dropout", 0.1, _FLOAT, "dropout on the attention probabilities"),
            ("--init-method-std", 0.02, _FLOAT, "standard deviation of the weight init"),
            (
                "--make-vocab-size-divisible-by",
                128,
                _POS,
                "pad the 256-byte vocabulary to a multiple of this * TP size (megatron's padding)",
            ),
        ],
    ),
    (
        "parallelism (data-parallel size = world size / (tp * pp * cp))",
        [
            (
                "--tensor-model-parallel-size",
                None,
                _POS,
                "ranks that split every layer (None: the largest size that divides the world "
                "size / pp and the attention heads, hidden and MLP widths)",
            ),
            (
                "--pipeline-model-parallel-size",
                1,
                _POS,
                "pipeline stages (1F1B schedule; layers split evenly, embedding on the first, "
                "loss on the last)",
            ),
            (
                "--num-layers-per-virtual-pipeline-stage",
                None,
                _POS,
                "layers per model chunk: vp = num layers / (pp * this) chunks per stage, run by "
                "the interleaved 1F1B schedule (None: no interleaving)",
            ),
            (
                "--context-parallel-size",
                1,
                _POS,
                "ranks that split the sequence for attention (NOTE [ Context parallelism ]; "
                "--seq-length divisible by 2 * this; --attention-dropout 0 with a2a)",
            ),
            (
                "--cp-comm-type",
                "p2p",
                {"choices": ["p2p", "all_gather", "a2a"]},
                "how context-parallel attention reaches the other ranks' keys",
            ),
            (
                "--attention-backend",
                "auto",
                {"choices": ["auto", "fused", "unfused"]},
                "core attention on torch's fused kernels where the inputs allow (auto), always "
                "(fused: an error where they cannot run) or the unfused computation that "
                "materializes the scores (NOTE [ Fused attention ])",
            ),
            (
                "--sequence-parallel",
                False,
                _FLAG,
                "split LayerNorm and dropout activations along the sequence over the TP group",
            ),
            (
                "--recompute-granularity",
                None,
                {"choices": ["full", "selective"]},
                "activation recompute: core attention only (selective) or whole layers (full)",
            ),
            (
                "--recompute-method",
                None,
                {"choices": ["uniform", "block"]},
                "with full: checkpoint chunks of N layers (uniform) or the first N layers (block)",
            ),
            ("--recompute-num-layers", None, {"type": int}, "the N of --recompute-method"),
            (
                "--distribute-saved-activations",
                False,
                _FLAG,
                "with full: keep each checkpoint's input split across the TP group",
            ),
            (
                "--memory-budget",
                None,
                {"type": str},
                "plan the recompute per layer to fit this many bytes per rank (2GiB, 512MB, 80%% "
                "of the device's memory): the fastest plan whose predicted peak fits, per "
                "pipeline stage; not with --recompute-granularity or interleaving",
            ),
            (
                "--device",
                "cpu",
                {"choices": ["cpu", "cuda"]},
                "cpu trains with gloo, cuda with nccl (one GPU per rank)",
            ),
        ],
    ),
    (
        "mixed precision (see megatron_core/training/mixed_precision.py)",
        [
            ("--bf16", False, _FLAG, "bf16 weights and activations, fp32 main grads and weights"),
            (
                "--fp16",
                False,
                _FLAG,
                "fp16 weights and activations, fp32 main grads and weights, dynamic loss scaling",
            ),
            ("--initial-loss-scale", 2.0**16, _FLOAT, "fp16: the first loss scale"),
            ("--min-loss-scale", 1.0, _FLOAT, "fp16: the loss scale never goes below this"),
            ("--loss-scale-window", 1000, _POS, "fp16: clean iterations before the scale doubles"),
            ("--hysteresis", 2, _POS, "fp16: overflows tolerated before the scale halves"),
        ],
    ),
    (
        "launching",
        [
            (
                "--nproc-per-node",
                1,
                _POS,
                "ranks to start when run as `python scripts/train_gpt.py` (the built-in "
                "launcher); ignored under torchrun, which sets the world size itself",
            ),
            (
                "--distributed-timeout-minutes",
                5.0,
                _FLOAT,
                "a collective waiting longer than this fails the job (torch's default is 30)",
            ),
            ("--debug", False, _FLAG, "show Python tracebacks (also: MEGATRON_CORE_DEBUG=1)"),
        ],
    ),
    (
        "training",
        [
            ("--train-iters", 600, _POS, "iterations; the learning-rate schedule spans them"),
            ("--micro-batch-size", 8, _POS, "samples per rank per forward"),
            (
                "--global-batch-size",
                None,
                _POS,
                "samples per iteration (None: micro batch size * data-parallel size); more "
                "accumulates gradients over microbatches",
            ),
            ("--lr", 3e-3, _FLOAT, "peak learning rate (AdamW)"),
            ("--min-lr", 3e-4, _FLOAT, "learning rate at the end of the cosine decay"),
            ("--lr-warmup-iters", 20, {"type": int}, "linear warmup iterations"),
            ("--weight-decay", 0.01, _FLOAT, "AdamW weight decay (not on biases and norms)"),
            ("--adam-beta1", 0.9, _FLOAT, "AdamW beta1"),
            ("--adam-beta2", 0.95, _FLOAT, "AdamW beta2"),
            ("--clip-grad", 1.0, _FLOAT, "clip the global gradient norm to this (0: off)"),
            ("--seed", 1234, {"type": int}, "random seed (weights, dropout, data order)"),
            (
                "--data",
                None,
                {"metavar": "PATH"},
                f"a text file to train on, read as bytes (None: {DEFAULT_CORPUS_DESCRIPTION})",
            ),
            ("--log-interval", 20, _POS, "iterations per progress line"),
            ("--save", None, {"metavar": "DIR"}, "save a checkpoint here at the end"),
            ("--save-interval", None, _POS, "also save every N iterations"),
            (
                "--exit-interval",
                None,
                _POS,
                "stop (and save) at the first iteration that is a multiple of N, keeping the "
                "schedule of --train-iters; resume with --load",
            ),
            ("--load", None, {"metavar": "DIR"}, "resume from the latest checkpoint in DIR"),
            (
                "--ckpt-step",
                None,
                {"type": int, "metavar": "N"},
                "with --load: load iteration N's checkpoint, not the one the tracker file names",
            ),
        ],
    ),
]


class _Parser(argparse.ArgumentParser):
    """Raises MegatronCoreError instead of printing usage and exiting (NOTE [ Clean exits ] in
    launcher.py prints it once, from rank 0); ``--help`` prints on global rank 0 only."""

    def error(self, message: str):
        raise MegatronCoreError(f"{message} (see {self.prog} --help)")

    def print_help(self, file=None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super().print_help(file)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of scripts/train_gpt.py."""
    parser = _Parser(
        prog="train_gpt.py",
        description="Train a small byte-level GPT with megatron_core's tensor parallelism. "
        "Run `python scripts/train_gpt.py --nproc-per-node 2` (or torchrun --standalone "
        "--nproc_per_node=2 scripts/train_gpt.py); CPU + gloo by default.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for title, arguments in _ARGUMENTS:
        group = parser.add_argument_group(title)
        for flag, default, kwargs, text in arguments:
            group.add_argument(flag, default=default, help=text, **kwargs)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) and check what needs no processes.

    Raises:
        MegatronCoreError: a value or combination that no world size makes valid.
    """
    args = build_parser().parse_args(argv)
    check_pipeline_args(args)
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise MegatronCoreError(
                f"--{name.replace('_', '-')} ({getattr(args, name)}) must be in [0, 1)"
            )
    if args.lr <= 0 or not 0 <= args.min_lr <= args.lr:
        raise MegatronCoreError(
            f"--lr ({args.lr}) must be > 0 and --min-lr ({args.min_lr}) in [0, lr]"
        )
    if args.lr_warmup_iters < 0:
        raise MegatronCoreError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be >= 0")
    if args.bf16 and args.fp16:
        raise MegatronCoreError("--bf16 and --fp16 exclude each other: choose one")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise MegatronCoreError(
            f"--min-loss-scale ({args.min_loss_scale}) must be > 0 and <= --initial-loss-scale "
            f"({args.initial_loss_scale})"
        )
    if args.distributed_timeout_minutes <= 0:
        raise MegatronCoreError(
            f"--distributed-timeout-minutes ({args.distributed_timeout_minutes}) must be > 0"
        )
    if args.save_interval is not None and args.save is None:
        raise MegatronCoreError(f"--save-interval ({args.save_interval}) needs --save DIR")
    if args.ckpt_step is not None and (args.load is None or args.ckpt_step < 0):
        raise MegatronCoreError(f"--ckpt-step ({args.ckpt_step}) needs --load DIR and must be >= 0")
    return args


def _cp(args: argparse.Namespace) -> int:
    return getattr(args, "context_parallel_size", 1) or 1


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    """world_size / (tp * pp * cp)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return world_size // (tp * pp * _cp(args))


def _tp_sizes_that_fit(args: argparse.Namespace, world_size: int) -> list[int]:
    """TP sizes that divide world size / pp and every split width (heads, hidden, MLP, and the
    sequence under sequence parallelism), ascending."""
    pp = args.pipeline_model_parallel_size * _cp(args)
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    widths = [args.num_attention_heads, args.hidden_size, ffn]
    if args.sequence_parallel:
        widths.append(args.seq_length // _cp(args))
    return [
        tp
        for tp in range(1, world_size // pp + 1)
        if world_size % (tp * pp) == 0 and all(w % tp == 0 for w in widths)
    ]


def _check_tp(args: argparse.Namespace, world_size: int, fits: list[int]) -> None:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, _cp(args)
    hint = f"; use --tensor-model-parallel-size {' or '.join(map(str, fits))}" if fits else ""
    if world_size % (tp * pp * cp):
        by_cp = f" * --context-parallel-size ({cp})" if cp > 1 else ""
        raise MegatronCoreError(
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) "
            f"* --pipeline-model-parallel-size ({pp}){by_cp}{hint}"
        )
    if args.num_attention_heads % tp:
        raise MegatronCoreError(
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}){hint}"
        )
    if args.sequence_parallel and (args.seq_length // cp) % tp:
        per_cp = f" / --context-parallel-size ({cp})" if cp > 1 else ""
        raise MegatronCoreError(
            f"--seq-length ({args.seq_length}){per_cp} must be divisible by "
            f"--tensor-model-parallel-size ({tp}) with --sequence-parallel{hint}"
        )


def _check_memory_budget(args: argparse.Namespace) -> None:
    budget = getattr(args, "memory_budget", None)
    if budget is None:
        return
    from megatron_core.tensor_parallel.recompute.planner import parse_memory_budget

    if "%" not in budget:  # a share needs the device, which the process may not have yet
        parse_memory_budget(budget)
    else:
        parse_memory_budget(budget, total_bytes=1)
    if args.recompute_granularity is not None:
        raise MegatronCoreError(
            f"--memory-budget ({budget}) chooses the recompute itself: drop "
            f"--recompute-granularity ({args.recompute_granularity})"
        )
    per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_chunk is not None and per_chunk < 2:
        raise MegatronCoreError(
            f"--memory-budget ({budget}) with --num-layers-per-virtual-pipeline-stage "
            f"({per_chunk}): the planner measures a chunk's layers one after another and "
            "needs at least 2 per chunk"
        )


def _check_cp(args: argparse.Namespace) -> None:
    cp = _cp(args)
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        raise MegatronCoreError(
            f"--seq-length ({args.seq_length}) must be divisible by 2 * --context-parallel-size "
            f"({2 * cp})"
        )
    if args.attention_dropout and args.cp_comm_type == "a2a":
        raise MegatronCoreError(
            f"--attention-dropout ({args.attention_dropout}) must be 0 with "
            f"--context-parallel-size ({cp}) and --cp-comm-type a2a"
        )


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Check what depends on the world size; fills in ``args.tensor_model_parallel_size`` (when
    None: the largest size that fits, see ``--help``) and ``args.global_batch_size``.

    Raises:
        MegatronCoreError: tp * pp does not divide the world size, the heads or the sequence
            (under sequence parallelism) do not split evenly (the message lists the TP sizes
            that fit), or the global batch is not a multiple of micro batch size *
            data-parallel size.
    """
    fits = _tp_sizes_that_fit(args, world_size)
    if args.tensor_model_parallel_size is None:
        if not fits:
            raise MegatronCoreError(
                f"no tensor-model-parallel size fits world size ({world_size}) with "
                f"--pipeline-model-parallel-size ({args.pipeline_model_parallel_size})"
            )
        args.tensor_model_parallel_size = fits[-1]
    _check_cp(args)
    _check_tp(args, world_size, fits)
    _check_memory_budget(args)
    dp = data_parallel_size(args, world_size)
    step = args.micro_batch_size * dp
    if args.global_batch_size is None:
        args.global_batch_size = step
    if args.global_batch_size % step:
        raise MegatronCoreError(
            f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({args.micro_batch_size}) * data-parallel size ({dp})"
        )
    check_pipeline_microbatches(args, args.global_batch_size // step)
