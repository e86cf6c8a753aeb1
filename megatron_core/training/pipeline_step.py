"""The main job's pipeline-parallel pieces: flags, building the stage's model chunks, one step.

With ``--pipeline-model-parallel-size`` pp > 1 each rank builds the chunks of its stage
(``--num-layers-per-virtual-pipeline-stage`` n gives vp = num_layers / (pp * n) chunks per stage,
megatron's interleaving) and a training step runs ``get_forward_backward_func()`` over the
microbatches instead of the plain loop. Gradient finalization, clipping and the optimizer step are
the loop's, shared with pp = 1.

# NOTE [ Same model at every pp ]
1. Weights. Every rank first builds the whole model (all layers, TP-sharded) from the seed exactly
   as pp = 1 does, then builds its chunks without initialization and copies its layers in by
   global layer index (``layer_offset``); the whole model is then dropped. A pp run therefore
   starts from the same parameters as the pp = 1 run (the cost: one whole model in host memory
   per rank while building). The chunks are built under a forked CPU RNG, so the RNG after
   building is also the same as at pp = 1.
2. Dropout. After building, stage r re-seeds with ``seed + 100 * r`` (megatron's offset), so the
   stages do not draw the same dropout masks. Runs with dropout therefore differ between pp
   sizes; without dropout they agree to rounding.
3. Loss. The last stage computes each microbatch's mean token loss; the schedule divides it by
   the number of microbatches, as the pp = 1 loop does. The logged loss is summed on the last
   stage in microbatch order and broadcast over the pipeline group.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_core.tensor_parallel.recompute.memory import count_saved_activations
from megatron_core.training.data import ByteCorpus, get_batch
from megatron_core.transformer import GPTModel, TransformerConfig

__all__ = [
    "virtual_pipeline_size",
    "check_pipeline_args",
    "check_pipeline_microbatches",
    "build_pipeline_model",
    "model_chunks",
    "reseed_stage",
    "pipeline_forward_backward",
]


def virtual_pipeline_size(args: argparse.Namespace) -> int | None:
    """vp = num_layers / (pp * --num-layers-per-virtual-pipeline-stage), or None."""
    n = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if n is None:
        return None
    return args.num_layers // (args.pipeline_model_parallel_size * n)


def check_pipeline_args(args: argparse.Namespace) -> None:
    """Raise MegatronCoreError for pipeline flags no world size makes valid."""
    pp, n = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    if n is not None and pp < 2:
        raise MegatronCoreError(
            f"--num-layers-per-virtual-pipeline-stage ({n}) needs --pipeline-model-parallel-size "
            f"> 1 (got {pp})"
        )
    if args.num_layers % pp:
        raise MegatronCoreError(
            f"--num-layers ({args.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp})"
        )
    if n is not None and (args.num_layers // pp) % n:
        raise MegatronCoreError(
            f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) must be "
            f"divisible by --num-layers-per-virtual-pipeline-stage ({n})"
        )


def check_pipeline_microbatches(args: argparse.Namespace, num_microbatches: int) -> None:
    """Interleaving needs the microbatches of a step divisible by pp (NOTE [ Interleaved 1F1B ])."""
    pp = args.pipeline_model_parallel_size
    if virtual_pipeline_size(args) is not None and num_microbatches % pp:
        raise MegatronCoreError(
            f"microbatches per step ({num_microbatches} = --global-batch-size / "
            f"(--micro-batch-size * data-parallel size)) must be divisible by "
            f"--pipeline-model-parallel-size ({pp}) with --num-layers-per-virtual-pipeline-stage"
        )


def _global_key(key: str, offset: int) -> str:
    prefix = "decoder.layers."
    if not key.startswith(prefix):
        return key
    index, rest = key[len(prefix) :].split(".", 1)
    return f"{prefix}{int(index) + offset}.{rest}"


def build_pipeline_model(
    config: TransformerConfig, vocab_size: int, seq_length: int, true_vocab_size: int | None = None
):
    """This stage's chunks, with the weights the pp = 1 model gets (NOTE [ Same model at every
    pp ], rule 1), on the current device. ``true_vocab_size``: see GPTModel.

    Returns:
        the GPTModel chunk (no interleaving), or a ModuleList of vp chunks (vp_stage 0, 1, ...).
    """
    whole = dataclasses.replace(
        config, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None
    )
    state = GPTModel(whole, vocab_size, seq_length, true_vocab_size=true_vocab_size).state_dict()
    vp = config.virtual_pipeline_model_parallel_size
    bare = dataclasses.replace(config, perform_initialization=False)
    chunks = []
    with torch.random.fork_rng(devices=[]):
        for stage in range(vp or 1):
            vp_stage = stage if vp is not None else None
            first = parallel_state.is_pipeline_first_stage(ignore_virtual=True) and stage == 0
            last = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and stage == (
                (vp or 1) - 1
            )
            chunk = GPTModel(
                bare, vocab_size, seq_length, first, last, vp_stage, true_vocab_size=true_vocab_size
            )
            chunk.load_state_dict(
                {key: state[_global_key(key, chunk.layer_offset)] for key in chunk.state_dict()}
            )
            chunks.append(chunk.to(device.current_device()))
    del state
    return chunks[0] if vp is None else torch.nn.ModuleList(chunks)


def model_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The chunks of a model from :func:`build_pipeline_model` (or [model])."""
    return list(model) if isinstance(model, torch.nn.ModuleList) else [model]


def reseed_stage(seed: int) -> None:
    """NOTE [ Same model at every pp ], rule 2."""
    model_parallel_cuda_manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())


def _forward_step(corpus, args, step, record, data_iterator, model):
    microbatch = next(data_iterator)
    tokens = labels = None
    if model.pre_process or model.post_process:
        tokens, labels = get_batch(corpus, args, step, microbatch)
    with count_saved_activations(ignore=model.parameters()) as report:
        output = model(tokens, labels if model.post_process else None)
    record.append(report.total_bytes)

    cp = parallel_state.get_context_parallel_world_size()

    def loss_func(per_token: torch.Tensor):
        loss = per_token.mean()
        # the schedule multiplies the loss by the CP size (megatron-core's convention, for a
        # loss that is this rank's share of the global mean) and finalize_model_grads averages
        # over data x context ranks: this rank's mean / cp is that share (equal token counts)
        return loss / cp, {"lm loss": loss.detach()}

    return output, loss_func


def pipeline_forward_backward(
    model, corpus: ByteCorpus, args, step: int, num_microbatches: int, grad_scale_func=None
):
    """Forward and backward of step ``step`` over the pipeline (gradients accumulate in place).

    ``grad_scale_func`` (the mixed-precision optimizer's ``scale_loss``) becomes the chunks'
    ``config.grad_scale_func``: the schedule scales each microbatch's loss with it before its
    backward, as megatron-core does.

    Returns:
        (the step's loss on this rank's data: sum over microbatches of loss / m, a 0-dim fp32
        tensor equal on every stage; peak saved-activation bytes of one microbatch forward of
        one chunk on this rank).
    """
    chunks = model_chunks(model)
    for chunk in chunks:
        chunk.config.grad_scale_func = grad_scale_func
    record: list[int] = []
    step_func = functools.partial(_forward_step, corpus, args, step, record)
    iterators = [iter(range(num_microbatches)) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=step_func,
        data_iterator=iterators
        if len(chunks) > 1 or isinstance(model, torch.nn.ModuleList)
        else iterators[0],
        model=chunks if isinstance(model, torch.nn.ModuleList) else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    total = torch.zeros((), dtype=torch.float32, device=device.current_device())
    for reduced in losses:  # in microbatch order, as the pp = 1 loop adds them
        total += reduced["lm loss"].float() / num_microbatches
    group = parallel_state.get_pipeline_model_parallel_group()
    dist.broadcast(total, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
    return total, max(record, default=0)
