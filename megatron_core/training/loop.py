"""The training loop of scripts/train_gpt.py, importable so that tests run it without torchrun.

One iteration: for each microbatch, get the batch (TP rank 0 builds it, ``broadcast_data`` sends
it to the TP group), forward counting the saved activations, backward; then finalize the
gradients (sequence-parallel grads summed over TP, all grads averaged over DP), clip by the
global norm, set the learning rate and step AdamW over this rank's shards.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import random
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_core import consistency, device, parallel_state
from megatron_core.distributed import finalize_model_grads
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_core.tensor_parallel.recompute.memory import count_saved_activations
from megatron_core.training import memory_plan
from megatron_core.training.arguments import validate_args
from megatron_core.training.data import VOCAB_SIZE, ByteCorpus, get_batch
from megatron_core.training.launcher import RENDEZVOUS_ENV, temporary_directory
from megatron_core.training.mixed_precision import DynamicLossScaler, MixedPrecisionOptimizer
from megatron_core.training.pipeline_step import (
    build_pipeline_model,
    model_chunks,
    pipeline_forward_backward,
    reseed_stage,
    virtual_pipeline_size,
)
from megatron_core.training.progress import Progress
from megatron_core.training.resume import resume, save
from megatron_core.transformer import GPTModel, TransformerConfig

__all__ = [
    "TrainingResult",
    "initialize_distributed",
    "padded_vocab_size",
    "model_config",
    "build_model_and_optimizer",
    "learning_rate",
    "train_step",
    "check_locally",
    "train",
]


@dataclass
class TrainingResult:
    """What :func:`train` returns on every rank.

    Attributes:
        losses: iteration (1-based) -> loss, the token mean averaged over data-parallel ranks.
        start_iteration: iterations already done when training started (loaded checkpoint).
        end_iteration: iterations done at the end.
        tokens_per_second: global tokens per second.
        activation_bytes: peak saved-tensor bytes of one microbatch forward on this rank.
        num_parameters: parameters of the whole model (every shard, replicated ones once).
        model: the trained model (this rank's shard).
        optimizer: its optimizer.
    """

    losses: dict[int, float]
    start_iteration: int
    end_iteration: int
    tokens_per_second: float
    activation_bytes: int
    num_parameters: int
    model: GPTModel
    optimizer: torch.optim.Optimizer


def initialize_distributed(device_type: str, timeout_minutes: float | None = None) -> None:
    """Choose the device, bind this rank to LOCAL_RANK's accelerator, init the process group.

    Under torchrun the group comes from its environment (RANK, WORLD_SIZE, MASTER_ADDR, ...);
    under the built-in launcher (``--nproc-per-node``) from RANK, WORLD_SIZE and a file
    rendezvous (``MEGATRON_CORE_RENDEZVOUS``); started alone (no RANK set) the process is a
    world of one, rendezvousing through a fresh temporary file. ``timeout_minutes`` bounds every
    collective (None: torch's default).
    """
    device.set_device_type(device_type)
    device.set_current_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return
    options = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
    backend = device.default_backend()
    if RENDEZVOUS_ENV in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend,
            init_method=os.environ[RENDEZVOUS_ENV],
            rank=rank,
            world_size=world_size,
            **options,
        )
        return
    if "RANK" in os.environ:
        dist.init_process_group(backend, **options)
        return
    rendezvous = os.path.join(temporary_directory("train_gpt_"), "rendezvous")
    dist.init_process_group(
        backend, init_method=f"file://{rendezvous}", rank=0, world_size=1, **options
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Round ``vocab_size`` up to a multiple of divisible_by * tp_size (megatron's padding)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def model_config(args: argparse.Namespace) -> TransformerConfig:
    """The TransformerConfig of ``args`` (validated). Weights are drawn full on the CPU, so a
    run's starting point does not depend on the tensor-parallel size. ``--sequence-parallel``
    with a tensor-parallel size of 1 is switched off with a warning (as Megatron-LM's argument
    checks do; ModelParallelConfig itself refuses that combination, as megatron-core's does).

    Raises:
        MegatronCoreError: the TP size is still None (call ``validate_args`` first) or the
            config is invalid.
    """
    if args.tensor_model_parallel_size is None:
        raise MegatronCoreError(
            "model_config: tensor_model_parallel_size is None; validate_args(args, world_size) "
            "chooses it"
        )
    sequence_parallel = args.sequence_parallel
    if sequence_parallel and args.tensor_model_parallel_size == 1:
        warnings.warn(
            "--sequence-parallel with a tensor-parallel size of 1: disabling sequence parallelism",
            stacklevel=2,
        )
        sequence_parallel = False
    return TransformerConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type,
        pipeline_dtype=_pipeline_dtype(args),
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        attention_backend=args.attention_backend,
        init_method_std=args.init_method_std,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        distribute_saved_activations=args.distribute_saved_activations,
        **_precision_options(args),
    )


def _pipeline_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """What stages send each other: the activations' dtype, that of the parameters."""
    if args.pipeline_model_parallel_size == 1:
        return None
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _precision_options(args: argparse.Namespace) -> dict:
    """--bf16 / --fp16: half-precision params, fp32 main_grad fusion (NOTE [ Mixed precision ])."""
    if not (args.bf16 or args.fp16):
        return {}
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    return {"bf16": args.bf16, "fp16": args.fp16, "params_dtype": dtype,
            "gradient_accumulation_fusion": True}  # fmt: skip


def build_model_and_optimizer(args: argparse.Namespace, config: TransformerConfig):
    """The GPTModel on the current device and an AdamW over its local parameters.

    Under pipeline parallelism the model is this stage's chunk, or a ModuleList of its chunks
    when interleaved (``pipeline_step.build_pipeline_model``). Biases and LayerNorm parameters
    (1-D) get no weight decay. Needs parallel_state initialized and the RNG seeded.
    """
    vocab = padded_vocab_size(
        VOCAB_SIZE, args.make_vocab_size_divisible_by, config.tensor_model_parallel_size
    )
    if config.pipeline_model_parallel_size > 1:
        model = build_pipeline_model(config, vocab, args.seq_length, true_vocab_size=VOCAB_SIZE)
    else:
        model = GPTModel(config, vocab, args.seq_length, true_vocab_size=VOCAB_SIZE)
        model = model.to(device.current_device())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
    )
    if config.bf16 or config.fp16:  # fp32 main weights (NOTE [ Mixed precision ])
        scaler = None
        if config.fp16:
            scaler = DynamicLossScaler(
                args.initial_loss_scale, args.min_loss_scale,
                growth_interval=args.loss_scale_window, hysteresis=args.hysteresis,
            )  # fmt: skip
        optimizer = MixedPrecisionOptimizer(optimizer, model, scaler)
    return model, optimizer


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warmup over lr_warmup_iters, then cosine decay to min_lr at train_iters."""
    if step < args.lr_warmup_iters:
        return args.lr * (step + 1) / args.lr_warmup_iters
    progress = min(
        1.0, (step - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    )
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1.0 + math.cos(math.pi * progress))


def _finalize_grads(model: torch.nn.Module) -> None:
    """SP-marked grads summed over TP, every grad averaged over the data-parallel group, tied
    embedding grads summed between the first and last pipeline stage (``finalize_model_grads``,
    NOTE [ Gradient finalization ])."""
    finalize_model_grads(model_chunks(model))


def _counted_once(p: torch.Tensor) -> bool:
    """Replicated params on TP rank 0 only; the last stage's tied-embedding copy not at all."""
    return param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False)


def _clip_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Scale the grads so that the global norm over all shards is at most ``max_norm``."""
    params = [p for p in model.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=device.current_device())
    for p in params:
        if _counted_once(p):  # replicated and tied params count once
            squares += p.grad.float().pow(2).sum()
    mp_group = parallel_state.get_model_parallel_group()
    consistency.checked_all_reduce("grad norm all_reduce", squares, mp_group)
    norm = squares.sqrt().item()
    if norm > max_norm:
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def train_step(model, optimizer, corpus: ByteCorpus, args: argparse.Namespace, step: int):
    """Run training step ``step`` (0-based); returns (loss averaged over DP, activation bytes).
    The step is one iteration of the check window (NOTE [ Check window ], rule 1), its
    schedule and gradient finalization included."""
    with consistency.iteration():
        return _train_step(model, optimizer, corpus, args, step)


def _train_step(model, optimizer, corpus: ByteCorpus, args: argparse.Namespace, step: int):
    optimizer.zero_grad(set_to_none=True)
    dp_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp_size)
    total = torch.zeros((), dtype=torch.float32, device=device.current_device())
    activation_bytes = 0
    mixed = isinstance(optimizer, MixedPrecisionOptimizer)
    if args.pipeline_model_parallel_size > 1:  # the loss is scaled by config.grad_scale_func
        total, activation_bytes = pipeline_forward_backward(
            model, corpus, args, step, num_microbatches, optimizer.scale_loss if mixed else None
        )
        num_microbatches = 0  # the schedule ran them
    for microbatch in range(num_microbatches):
        tokens, labels = get_batch(corpus, args, step, microbatch)
        with count_saved_activations(ignore=model.parameters()) as report:
            loss = model(tokens, labels).mean() / num_microbatches
        (optimizer.scale_loss(loss) if mixed else loss).backward()
        total += loss.detach()
        activation_bytes = max(activation_bytes, report.total_bytes)
    # Mixed precision: the fp32 main weights, whose .grad is the (unscaled) main_grad buffer
    # that finalize_model_grads reduces on the model (NOTE [ Mixed precision ], rule 3).
    grads_of = optimizer.prepare_grads() if mixed else model
    _finalize_grads(model)
    if args.clip_grad > 0:
        _clip_grads(grads_of, args.clip_grad)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(args, step)
    optimizer.step()
    # every data x context rank's mean over its tokens: equal token counts, so their mean is
    # the global batch's per-token mean (NOTE [ Context parallelism ])
    consistency.checked_all_reduce(
        "loss all_reduce",
        total,
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    cp_size = parallel_state.get_context_parallel_world_size()
    return total.item() / (dp_size * cp_size), activation_bytes


def _count_parameters(model: torch.nn.Module) -> int:
    local = sum(p.numel() for p in model.parameters() if _counted_once(p))
    count = torch.tensor([local], dtype=torch.int64, device=device.current_device())
    consistency.checked_all_reduce(
        "parameter count all_reduce", count, parallel_state.get_model_parallel_group()
    )
    return int(count.item())


def _describe(args, corpus: ByteCorpus, config: TransformerConfig, num_parameters: int) -> str:
    dp = parallel_state.get_data_parallel_world_size()
    recompute = config.recompute_granularity or "none"
    if config.recompute_granularity == "full":
        recompute += f" ({config.recompute_method}, {config.recompute_num_layers} layers"
        recompute += ", distributed)" if config.distribute_saved_activations else ")"
    cp = f"cp={config.context_parallel_size}"
    if config.context_parallel_size > 1:
        cp += f" ({config.cp_comm_type})"
    return (
        f"train_gpt: {dist.get_world_size()} ranks on {device.device_type()} "
        f"({dist.get_backend()}): tp={config.tensor_model_parallel_size} "
        f"pp={config.pipeline_model_parallel_size} dp={dp} {cp} "
        f"sequence_parallel={config.sequence_parallel} recompute={recompute} "
        f"attention={config.attention_backend}\n"
        f"model: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, seq {args.seq_length}, {num_parameters:,} "
        f"parameters; batch {args.global_batch_size} x {args.seq_length} tokens "
        f"(micro batch {args.micro_batch_size})\ndata: {corpus.name}, {len(corpus):,} bytes"
    )


class _ProgressNotes(logging.Handler):
    """The package's attention log lines (a kernel fallback, NOTE [ Fused attention ], rule 2)
    as "note:" lines of the main job's output, rank 0 only, instead of stderr."""

    def __init__(self, progress: Progress):
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.print(f"note: {record.getMessage()}")


def _notes_to(progress: Progress) -> None:
    attention_log = logging.getLogger("megatron_core.attention")
    for handler in [h for h in attention_log.handlers if isinstance(h, _ProgressNotes)]:
        attention_log.removeHandler(handler)  # an earlier run in this process
    attention_log.addHandler(_ProgressNotes(progress))
    attention_log.propagate = False


def _run(args, config: TransformerConfig, corpus: ByteCorpus) -> TrainingResult:
    random.seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    model, optimizer = build_model_and_optimizer(args, config)
    if args.pipeline_model_parallel_size > 1:
        reseed_stage(args.seed)
    num_parameters = _count_parameters(model)
    start, resume_lines = 0, []
    if args.load:
        start, resume_lines = resume(args, model, optimizer)
    tokens_per_iteration = args.global_batch_size * args.seq_length
    progress = Progress(
        dist.get_rank() == 0,
        args.train_iters,
        args.log_interval,
        tokens_per_iteration,
        dist.get_world_size(),
    )
    progress.print(_describe(args, corpus, config, num_parameters))
    _notes_to(progress)
    for line in resume_lines:
        progress.print(line)
    losses, end, plan = {}, start, None
    if getattr(args, "memory_budget", None) is not None and start < args.train_iters:
        plan, lines = memory_plan.plan_to_budget(args, model, optimizer, corpus, start)
        for line in lines:
            progress.print(line)
    for step in range(start, args.train_iters):
        if plan is not None and step == min(start + 1, args.train_iters - 1):
            (loss, activation_bytes), line = memory_plan.measured_iteration(
                functools.partial(train_step, model, optimizer, corpus, args, step),
                model,
                optimizer,
                plan,
            )
            progress.print(line)
        else:
            loss, activation_bytes = train_step(model, optimizer, corpus, args, step)
        end = step + 1
        losses[end] = loss
        progress.step(end, loss, learning_rate(args, step), activation_bytes)
        if getattr(optimizer, "last_step_skipped", False):
            progress.print(
                f"iteration {end}: update skipped (fp16 gradient overflow); loss scale now "
                f"{optimizer.loss_scale:g}, {optimizer.skipped_iterations} skipped so far"
            )
        if args.exit_interval and end % args.exit_interval == 0:
            progress.print(f"exiting at iteration {end} (--exit-interval {args.exit_interval})")
            break
        if args.save and args.save_interval and end % args.save_interval == 0:
            if end < args.train_iters:
                save(args, end, model, optimizer, progress)
    if args.save and losses:
        save(args, end, model, optimizer, progress)
    progress.summary(start, end)
    if isinstance(optimizer, MixedPrecisionOptimizer) and optimizer.loss_scaler is not None:
        progress.print(
            f"fp16: {optimizer.skipped_iterations} skipped iterations, final loss scale "
            f"{optimizer.loss_scale:g}"
        )
    return TrainingResult(
        losses=losses,
        start_iteration=start,
        end_iteration=end,
        tokens_per_second=progress.tokens_per_second(),
        activation_bytes=progress.peak_activation_bytes,
        num_parameters=num_parameters,
        model=model,
        optimizer=optimizer,
    )


def check_locally(args: argparse.Namespace, world_size: int) -> ByteCorpus:
    """Run every check of :func:`train` that needs no peer (layout, model, data) for
    ``world_size`` ranks and return the corpus; a launcher calls it before the process group
    starts (NOTE [ Clean exits ], rule 1). Raises MegatronCoreError as those checks do."""
    validate_args(args, world_size)
    model_config(args)
    return ByteCorpus.load(args.data, args.seq_length)


def train(args: argparse.Namespace, corpus: ByteCorpus | None = None) -> TrainingResult:
    """Train a GPT as ``args`` (from :func:`~megatron_core.training.arguments.parse_args`) says.

    Call on every rank with torch.distributed initialized (torchrun +
    :func:`initialize_distributed`, or ``megatron_core.testing.run_distributed``).
    parallel_state is initialized here and destroyed on return. ``corpus``: the one
    :func:`check_locally` returned (None: read ``args.data`` here).

    Raises:
        MegatronCoreError: torch.distributed not initialized, or invalid arguments (raised
            before any collective), or a failed checkpoint load/save (on every rank).
    """
    if not dist.is_initialized():
        raise MegatronCoreError(
            "train: torch.distributed is not initialized; launch scripts/train_gpt.py with "
            "torchrun, or call initialize_distributed() first"
        )
    validate_args(args, dist.get_world_size())
    config = model_config(args)
    corpus = ByteCorpus.load(args.data, args.seq_length) if corpus is None else corpus
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        context_parallel_size=args.context_parallel_size,
    )
    try:
        return _run(args, config, corpus)
    finally:
        parallel_state.destroy_model_parallel()
