"""Per-rank body: megatron-core's DistributedDataParallel and get_megatron_optimizer on this core.

megatron-core's own GPTModel wrapped in its DistributedDataParallel (grad buffers, optionally
overlap_grad_reduce) and stepped by the optimizer get_megatron_optimizer builds (optionally the
distributed optimizer), with parallel_state / tensor_parallel / finalize_model_grads served by
this package through the switch.
"""

from __future__ import annotations

import dataclasses

import torch
from _megatron_gpt import (
    BATCH,
    SEQ,
    Run,
    _forward_step,
    batch,
    build_model,
    cpu_only_cuda_calls,
    full_tensor,
    initialize,
    load_full,
)

GLOBAL_MICROBATCHES = 4  # per step, split over the data-parallel ranks


@dataclasses.dataclass
class DDPRun:
    """The data-parallel settings of one run (picklable)."""

    run: Run
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    megatron_finalize: bool = False  # megatron-core's own finalize_model_grads instead of ours


def megatron_cores_finalize_model_grads():
    """megatron-core's own finalize_model_grads (the switch serves ours under its name), loaded
    from its file under a private name; it runs on this package's parallel_state."""
    import importlib.util
    import os

    import megatron.core.distributed as package

    path = os.path.join(os.path.dirname(package.__file__), "finalize_model_grads.py")
    name = "megatron.core.distributed._megatron_cores_finalize_model_grads"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.finalize_model_grads


def _wrap(ddp_run: DDPRun, model):
    """megatron-core's DDP around ``model`` (grads in its buffers, as ``param.main_grad``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=ddp_run.overlap_grad_reduce,
        use_distributed_optimizer=ddp_run.distributed_optimizer,
        bucket_size=4096 if ddp_run.overlap_grad_reduce else None,  # several buckets
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def _gather_reduced_shards(ddp, dp_group) -> None:
    """With ``use_distributed_optimizer`` DDP reduce-scatters each bucket: data-parallel rank r
    holds the reduced r-th equal shard of ``bucket.grad_data``. The distributed optimizer steps
    only that shard; the test, stepping a torch SGD, all-gathers the shards first."""
    dp_size = torch.distributed.get_world_size(dp_group)
    dp_rank = torch.distributed.get_rank(dp_group)
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            shards = list(bucket.grad_data.chunk(dp_size))
            torch.distributed.all_gather(shards, shards[dp_rank].clone(), group=dp_group)


def train_ddp(ddp_run: DDPRun, full: dict[str, torch.Tensor]) -> dict:
    """``run.steps`` steps; each data-parallel rank trains on its own microbatches. Returns the
    losses (averaged over data-parallel ranks), the reduced unsharded gradients of every step
    and the final unsharded parameters."""
    with cpu_only_cuda_calls():
        return _train_ddp(ddp_run, full)


def _train_ddp(ddp_run: DDPRun, full: dict[str, torch.Tensor]) -> dict:
    run = ddp_run.run
    initialize(run)
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_model(run)
    load_full(model, full)
    ddp = _wrap(ddp_run, model)
    # get_megatron_optimizer cannot run on a CPU (README, porting): a torch SGD over main_grad.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    config = model.config
    config.finalize_model_grads_func = (
        megatron_cores_finalize_model_grads() if ddp_run.megatron_finalize else finalize_model_grads
    )
    config.no_sync_func = ddp.no_sync
    if ddp_run.overlap_grad_reduce:
        config.grad_sync_func = ddp.start_grad_sync
    dp_rank = parallel_state.get_data_parallel_rank()
    microbatches = GLOBAL_MICROBATCHES // parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    names = {n: n for n, _ in model.named_parameters()}
    losses, grads = [], []
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
        if ddp_run.distributed_optimizer:
            _gather_reduced_shards(ddp, dp_group)
        loss = torch.stack([r["loss"] for r in reports]).mean()
        torch.distributed.all_reduce(loss, group=dp_group)
        losses.append(loss / parallel_state.get_data_parallel_world_size())
        grads.append({names[n]: full_tensor(p, p.main_grad) for n, p in model.named_parameters()})
        for param in model.parameters():
            param.grad = param.main_grad
        optimizer.step()
    params = {n: full_tensor(p, p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}
