"""Per-rank bodies: megatron-core 0.19's HybridModel with its own ``hybrid_stack_spec`` (the
Transformer Engine modules, served by the stand-in) for attention, MLP and MoE layers.

Every run starts from the TP = 1 model's initial weights cut for its tensor-parallel rank and
reports, per step, the loss and the unsharded gradients, plus the final parameters.
"""

from __future__ import annotations

import dataclasses

import torch
from _megatron_gpt import batch
from _megatron_te_gpt import load, unshard

from megatron_core import device
from megatron_core import megatron as switch

VOCAB, SEQ, HIDDEN, HEADS, GROUPS, EXPERTS = 64, 8, 16, 4, 2, 4


@dataclasses.dataclass
class HybridRun:
    """One run's settings (picklable)."""

    pattern: str = "*-E*"
    tp: int = 1
    sp: bool = False
    steps: int = 2
    seed: int = 1234


def initialize(run: HybridRun) -> None:
    switch.install()
    from megatron.core import parallel_state, tensor_parallel

    # experts replicated over TP (megatron-core allows expert biases only with ETP = 1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=run.tp, expert_tensor_parallel_size=1
    )
    tensor_parallel.model_parallel_cuda_manual_seed(run.seed)


def build_model(run: HybridRun):
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=len(run.pattern),
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_grouped_gemm=True,
        moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=run.tp,
        expert_tensor_parallel_size=1,
        sequence_parallel=run.sp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    model = HybridModel(
        config,
        hybrid_stack_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern=run.pattern,
        position_embedding_type="rope",
    )
    return model.to(device.current_device())


def initial_state(run: HybridRun) -> dict[str, torch.Tensor]:
    """The TP = 1 model's initial parameters (one rank)."""
    one = dataclasses.replace(run, tp=1, sp=False)
    initialize(one)
    return {n: p.detach().cpu() for n, p in build_model(one).named_parameters()}


def train(run: HybridRun, full: dict[str, torch.Tensor]) -> dict:
    """``run.steps`` SGD steps; per step the loss and the unsharded gradients."""
    initialize(run)
    from megatron.core.distributed import finalize_model_grads

    model = build_model(run)
    params = dict(model.named_parameters())
    names = {n: n for n in params}
    load(model, names, full, gated=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(run.steps):
        optimizer.zero_grad()
        data = batch(step)
        out = model(data["input_ids"], data["position_ids"], None, labels=data["labels"])
        loss = out.float().mean()
        loss.backward()
        finalize_model_grads([model])
        losses.append(loss.detach().cpu())
        grads.append({n: unshard(p, p.grad, n, gated=False) for n, p in params.items()})
        optimizer.step()
    final = {n: unshard(p, p, n, gated=False) for n, p in params.items()}
    kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("TE")})
    return {"losses": losses, "grads": grads, "params": final, "te_modules": kinds}


def refused(pattern: str) -> str:
    """The error a pattern with a CUDA-only layer type raises (NOTE [ Without Transformer
    Engine ], rule 7), or "built"."""
    from megatron_core.errors import MegatronCoreError

    run = HybridRun(pattern=pattern)
    initialize(run)
    try:
        build_model(run)
    except MegatronCoreError as exc:
        return str(exc)
    return "built"
