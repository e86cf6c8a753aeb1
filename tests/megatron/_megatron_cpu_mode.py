"""Per-rank bodies for the CPU mode's end-to-end tests: megatron-core's CUDA-only code, unpatched.

Nothing here patches torch.cuda or megatron-core: the switch's CPU mode (on by default without
CUDA, megatron_core/megatron/cpu_mode.py) is what lets megatron-core's literal ``device="cuda"``
and ``torch.cuda.current_device()`` run on the gloo CPU ranks. Each body asserts that the mode is
on, so a run without it fails instead of passing through some other route.
"""

from __future__ import annotations

import dataclasses

import torch
from _megatron_gpt import Run, batch, build_model, causal_mask, full_tensor, initialize, load_full

from megatron_core.megatron import cpu_mode


def _start(run: Run) -> None:
    initialize(run)  # installs the switch: auto mode turns the CPU mode on (no CUDA here)
    assert cpu_mode.is_active(), "the switch's CPU mode is not on"


def gpt_loss(run: Run, full: dict[str, torch.Tensor], default_mask: bool) -> torch.Tensor:
    """megatron-core's GPTModel's per-token loss on one batch; with ``default_mask`` the model is
    given ``attention_mask=None`` and builds its causal mask itself (on device="cuda")."""
    _start(run)
    model = build_model(run)
    load_full(model, full)
    data = batch(0)
    mask = None if default_mask else causal_mask()
    with torch.no_grad():
        return model(data["input_ids"], data["position_ids"], mask, labels=data["labels"])


def megatron_adam_step(run: Run, full: dict[str, torch.Tensor], lr: float) -> dict:
    """One training step of megatron-core's GPTModel in its DistributedDataParallel, stepped by
    the optimizer ``get_megatron_optimizer`` builds (Adam, fp32, gradient clipping on) and with
    the model's default causal mask. Returns the loss, the grad norm the optimizer reports, the
    unsharded reduced gradients and the unsharded parameters after the step."""
    _start(run)
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build_model(run)
    load_full(model, full)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=model,
    )
    config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0)
    optimizer = get_megatron_optimizer(config, [ddp])
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    data = batch(0)
    loss = ddp(data["input_ids"], data["position_ids"], None, labels=data["labels"]).mean()
    loss.backward()
    finalize_model_grads([ddp])
    grads = {n: full_tensor(p, p.main_grad) for n, p in model.named_parameters()}
    updated, grad_norm, _ = optimizer.step()
    return {
        "updated": updated,
        "loss": loss.detach(),
        "grad_norm": grad_norm,
        "grads": grads,
        "params": {n: full_tensor(p, p) for n, p in model.named_parameters()},
    }


def initial_state(run: Run) -> dict[str, torch.Tensor]:
    """The unsharded initial parameters of ``run``'s model at tp = 1 (one rank)."""
    one = dataclasses.replace(run, tp=1)
    _start(one)
    return {n: p.detach().clone() for n, p in build_model(one).named_parameters()}


def checkpoint_round_trip(run: Run, full: dict[str, torch.Tensor], directory: str) -> dict:
    """megatron-core's ``dist_checkpointing.save`` (its torch_dist writer calls
    ``torch.cuda.synchronize()`` and makes a tensor on ``torch.cuda.current_device()``) and
    ``load`` into a model of another seed; returns the unsharded loaded parameters and whether
    the fresh model differed before loading."""
    _start(run)
    from megatron.core import dist_checkpointing, tensor_parallel

    model = build_model(run)
    load_full(model, full)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    tensor_parallel.model_parallel_cuda_manual_seed(run.seed + 1)
    fresh = build_model(run)
    differed = any(not torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), directory))
    params = {n: full_tensor(p, p) for n, p in fresh.named_parameters()}
    return {"differed": differed, "params": params}
