"""Per-rank body: a full megatron-core training step on this core, as megatron's trainer runs it.

megatron-core's own GPTModel (bf16 runs: in its ``Float16Module``) wrapped in its
DistributedDataParallel (grad buffers, optionally ``overlap_grad_reduce``), the forward and
backward of megatron-core's schedule API, ``finalize_model_grads`` and the optimizer
``get_megatron_optimizer`` builds (Adam; optionally the distributed optimizer), with
parallel_state / tensor_parallel / pipeline_parallel / finalize_model_grads served by this
package through the switch. Nothing here patches torch or megatron-core: on a torch without CUDA
the switch's CPU mode answers megatron-core's CUDA calls (grad buffers on
``torch.cuda.current_device()``, the optimizers' ``device='cuda'`` tensors, DDP's
``current_stream()``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _megatron_gpt import (
    BATCH,
    SEQ,
    Run,
    _forward_step,
    batch,
    build_model,
    full_tensor,
    initialize,
    install,
    load_full,
)

from megatron_core.testing import shares_gpus


def skip_where_gloo_carries_the_buckets(world_size: int) -> None:
    """Skip in the harness's CUDA mode where ``world_size`` ranks share the GPUs: gloo then
    carries megatron-core DDP's CUDA grad buckets and refuses the coalesced all-reduce its
    ``start_grad_sync`` issues (NCCL, one GPU per rank, runs it)."""
    if shares_gpus(world_size):
        pytest.skip(
            f"{world_size} ranks share the GPUs: gloo carries megatron-core DDP's CUDA buckets and "
            "refuses its coalesced all-reduce (allreduce_coalesced: unsupported device type cuda)"
        )

GLOBAL_MICROBATCHES = 4  # per step, split over the data-parallel ranks


@dataclasses.dataclass
class DDPRun:
    """The data-parallel and optimizer settings of one run (picklable)."""

    run: Run
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    megatron_finalize: bool = False  # megatron-core's own finalize_model_grads instead of ours
    bf16: bool = False  # bf16 parameters (Float16Module), fp32 main params in the optimizer
    lr: float = 1e-3


def megatron_cores_finalize_module():
    """megatron-core's own finalize_model_grads module (the switch serves ours under its name),
    loaded from its file under a private name with the switch installed first, so its imports
    are this package's parallel_state and it runs on it. (Importing megatron-core's module by
    its own name before the switch would import megatron-core's parallel_state, and a later
    install() in the same process is refused: the rank processes are reused by other tests.)"""
    import importlib.util
    import os

    install()
    import megatron.core.distributed as package

    path = os.path.join(os.path.dirname(package.__file__), "finalize_model_grads.py")
    name = "megatron.core.distributed._megatron_cores_finalize_model_grads"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wrap(ddp_run: DDPRun, model):
    """megatron-core's DDP around ``model`` (grads in its buffers, as ``param.main_grad``); a
    bf16 run puts the model in megatron-core's Float16Module first, as megatron's trainer does."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if ddp_run.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=ddp_run.overlap_grad_reduce,
        use_distributed_optimizer=ddp_run.distributed_optimizer,
        bucket_size=4096 if ddp_run.overlap_grad_reduce else None,  # several buckets
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def _optimizer(ddp_run: DDPRun, ddp):
    """What ``get_megatron_optimizer`` builds for ``ddp_run``: Adam (its torch fallback without
    Transformer Engine or apex), clipping at 1, fp32 main params for bf16 parameters."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=ddp_run.lr,
        weight_decay=0.0,
        clip_grad=1.0,
        bf16=ddp_run.bf16,
        params_dtype=torch.bfloat16 if ddp_run.bf16 else torch.float32,
        use_distributed_optimizer=ddp_run.distributed_optimizer,
    )
    return get_megatron_optimizer(config, [ddp])


def _gather_reduced_shards(ddp, dp_group) -> None:
    """With ``use_distributed_optimizer`` DDP reduce-scatters each bucket: data-parallel rank r
    holds the reduced r-th equal shard of ``bucket.grad_data`` (the only part its optimizer
    reads). To record every reduced gradient, the shards are all-gathered into the other parts."""
    dp_size = torch.distributed.get_world_size(dp_group)
    dp_rank = torch.distributed.get_rank(dp_group)
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            shards = list(bucket.grad_data.chunk(dp_size))
            torch.distributed.all_gather(shards, shards[dp_rank].clone(), group=dp_group)


def _main_params(optimizer, model, dp_group) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 main copy of each of ``model``'s bf16 parameters (this rank's TP
    shard, whole over data-parallel ranks), by parameter name.

    ``Float16OptimizerWithFloat16Params`` keeps ``fp32_from_float16_groups`` beside
    ``float16_groups``. The distributed optimizer keeps, on each data-parallel rank, the fp32
    shard of the range ``_get_model_param_range_map(param)["param"]`` of the parameters that
    have one there (``shard_fp32_from_float16_groups`` beside ``model_float16_groups``); the
    ranges of the ranks are disjoint and cover each parameter, so every parameter, in the same
    order on every rank, is summed whole over the data-parallel group."""
    whole: dict[int, torch.Tensor] = {}
    sharded = False
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "shard_fp32_from_float16_groups"):
            sharded = True
            pairs = zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups)
            for params, shards in pairs:
                for param, shard in zip(params, shards):
                    where = inner._get_model_param_range_map(param)["param"]
                    flat = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
                    flat[where.start : where.end] = shard.detach().view(-1)
                    whole[id(param)] = flat.view(param.shape)
        else:
            for params, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups):
                for param, main in zip(params, mains):
                    whole[id(param)] = main.detach().clone()
    found = {}
    for name, param in model.named_parameters():
        if sharded:
            zeros = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            part = whole.get(id(param), zeros)
            torch.distributed.all_reduce(part, group=dp_group)
            found[name] = part
        elif id(param) in whole:
            found[name] = whole[id(param)]
    missing = [n for n, _ in model.named_parameters() if n not in found]
    assert not missing, f"no main parameter for {missing}"
    return found


def train_ddp(ddp_run: DDPRun, full: dict[str, torch.Tensor]) -> dict:
    """``run.steps`` training steps; each data-parallel rank trains on its own microbatches.

    Returns the losses (averaged over data-parallel ranks), per step the reduced unsharded
    gradients (``main_grad``, fp32) and the grad norm the optimizer reports, and the final
    unsharded parameters (fp32; bf16 runs: the optimizer's fp32 main parameters, and whether
    every bf16 parameter is its main parameter rounded to bf16).
    """
    run = ddp_run.run
    initialize(run)
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_model(run)
    model.config.bf16 = ddp_run.bf16  # what Float16Module reads
    load_full(model, full)
    ddp = _wrap(ddp_run, model)
    optimizer = _optimizer(ddp_run, ddp)
    config = model.config
    config.finalize_model_grads_func = (
        megatron_cores_finalize_module().finalize_model_grads
        if ddp_run.megatron_finalize
        else finalize_model_grads
    )
    config.no_sync_func = ddp.no_sync
    if ddp_run.overlap_grad_reduce:
        config.grad_sync_func = ddp.start_grad_sync
    dp_rank = parallel_state.get_data_parallel_rank()
    microbatches = GLOBAL_MICROBATCHES // parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    losses, grads, norms = [], [], []
    for step in range(run.steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        first = dp_rank * microbatches
        data = iter([batch(step, first + m) for m in range(microbatches)])
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=microbatches,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=False,
        )
        loss = torch.stack([r["loss"] for r in reports]).mean()
        torch.distributed.all_reduce(loss, group=dp_group)
        losses.append((loss / parallel_state.get_data_parallel_world_size()).cpu())
        if ddp_run.distributed_optimizer:
            _gather_reduced_shards(ddp, dp_group)
        grads.append({n: full_tensor(p, p.main_grad) for n, p in model.named_parameters()})
        updated, grad_norm, _ = optimizer.step()
        assert updated, f"step {step}: the optimizer skipped its update"
        norms.append(torch.as_tensor(grad_norm, dtype=torch.float64))
    result = {"losses": losses, "grads": grads, "norms": norms}
    if ddp_run.bf16:
        mains = _main_params(optimizer, model, dp_group)
        params = dict(model.named_parameters())
        result["rounded"] = all(
            torch.equal(params[n], m.to(params[n].dtype)) for n, m in mains.items()
        )
        result["params"] = {n: full_tensor(params[n], m) for n, m in mains.items()}
    else:
        result["params"] = {n: full_tensor(p, p) for n, p in model.named_parameters()}
    return result
