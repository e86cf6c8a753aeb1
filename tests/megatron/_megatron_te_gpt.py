"""Per-rank bodies: megatron-core's GPTModel with its Transformer Engine layer spec, on the
stand-in the switch serves, against the same model built with megatron-core's local spec.

Both models are GQA + RoPE + SwiGLU + RMSNorm without biases (the settings a current model
uses); the TE-spec one runs RoPE through the stand-in's fused kernel (``apply_rope_fusion``),
the local one through megatron-core's unfused RoPE. Every run starts from the local model's
TP = 1 initial weights, renamed to Transformer Engine's names (:func:`te_name`) and cut for its
tensor / expert-parallel rank, and reports per step the loss and every gradient under its
local TP = 1 name, unsharded, plus the final parameters. Sizes are tiny: the tests compare.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _megatron_gpt import batch

from megatron_core import device
from megatron_core import megatron as switch

VOCAB, SEQ, BATCH, HIDDEN, HEADS, GROUPS, FFN, LAYERS, EXPERTS = 64, 8, 2, 16, 4, 2, 32, 2, 4


@dataclasses.dataclass
class TeRun:
    """One run's settings (picklable)."""

    spec: str = "te"  # "te" (the Transformer Engine spec on the stand-in) or "local"
    tp: int = 1
    sp: bool = False
    ep: int = 1
    cp: int = 1  # context parallel: the stand-in's DotProductAttention on context_parallel
    moe: bool = False  # experts: TE spec with GroupedLinear, local spec with SequentialMLP
    steps: int = 2
    seed: int = 1234


def initialize(run: TeRun) -> None:
    switch.install()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=run.tp,
        expert_model_parallel_size=run.ep,
        context_parallel_size=run.cp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(run.seed)


def config_of(run: TeRun):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if run.moe:
        extra = dict(
            num_moe_experts=EXPERTS,
            moe_router_topk=2,
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=run.spec == "te",
            expert_model_parallel_size=run.ep,
        )
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        tensor_model_parallel_size=run.tp,
        context_parallel_size=run.cp,
        sequence_parallel=run.sp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_rope_fusion=run.spec == "te",
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        **extra,
    )


def build_model(run: TeRun):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    experts = EXPERTS if run.moe else None
    if run.spec == "te":
        spec = get_gpt_layer_with_transformer_engine_spec(experts, moe_grouped_gemm=run.moe)
    else:
        spec = get_gpt_layer_local_spec(experts, normalization="RMSNorm")
    model = GPTModel(
        config=config_of(run),
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    return model.to(device.current_device())


def te_name(local: str, moe: bool) -> str:
    """A local-spec parameter's name in the TE-spec model (norms fused into the next linear,
    except the MoE layer's; SequentialMLP's experts as GroupedLinear's numbered weights)."""
    local = local.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    if ".mlp.experts.local_experts." in local:
        head, tail = local.split(".mlp.experts.local_experts.")
        expert, rest = tail.split(".", 1)  # "0", "linear_fc1.weight"
        return f"{head}.mlp.experts.{rest}{expert}"
    if not moe:
        return local.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    return local


def local_names(model, run: TeRun) -> dict[str, str]:
    """This rank's parameter name -> its local-spec, TP = EP = 1 name."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    per_rank = EXPERTS // run.ep
    wanted = {}
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}"
        names = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"]
        names += ["input_layernorm.weight", "pre_mlp_layernorm.weight"]
        if run.moe:
            names.append("mlp.router.weight")
            for e in range(EXPERTS):
                names += [f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for i in (1, 2)]
        else:
            names += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        wanted.update({f"{prefix}.{n}": f"{prefix}.{n}" for n in names})
    wanted.update({n: n for n in ("embedding.word_embeddings.weight", "output_layer.weight")})
    wanted["decoder.final_layernorm.weight"] = "decoder.final_layernorm.weight"
    mine = {}
    for canonical in wanted:
        name = te_name(canonical, run.moe) if run.spec == "te" else canonical
        if run.moe and ".experts." in canonical:
            expert = int(canonical.split("local_experts.")[1].split(".")[0])
            if expert // per_rank != ep_rank:
                continue
            local = str(expert % per_rank)
            name = name.replace(f"weight{expert}", f"weight{local}")
            name = name.replace(f"local_experts.{expert}.", f"local_experts.{local}.")
        mine[name] = canonical
    return mine


def _gated(name: str, gated: bool = True) -> bool:
    """Whether ``name`` is a gated (SwiGLU) FC1 weight: [gate; up], each half split over TP."""
    return gated and (
        name.endswith("mlp.linear_fc1.weight")
        or ("linear_fc1.weight" in name and ".experts." in name)
    )


def _group_of(param):
    from megatron.core import parallel_state

    if getattr(param, "allreduce", True) is False:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def unshard(param, tensor, canonical: str, gated: bool = True) -> torch.Tensor:
    """``tensor`` (the param or its gradient) gathered over its TP group, a gated FC1's
    [gate_r; up_r] shards put back as [gate; up]."""
    group = _group_of(param)
    size = dist.get_world_size(group)
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return tensor.detach().cpu().clone()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    if _gated(canonical, gated):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves]).cpu()
    return torch.cat(parts, dim=param.partition_dim).cpu()


def load(model, names: dict[str, str], full: dict[str, torch.Tensor], gated: bool = True) -> None:
    """Copy this rank's cut of ``full`` (local TP = 1 names) into ``model``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, canonical in names.items():
            param, value = params[name], full[canonical]
            group = _group_of(param)
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            if getattr(param, "tensor_model_parallel", False) and size > 1:
                if _gated(canonical, gated):
                    gate, up = value.chunk(2)
                    value = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
                else:
                    value = value.chunk(size, dim=param.partition_dim)[rank]
            param.copy_(value)


def initial_state(run: TeRun) -> dict[str, torch.Tensor]:
    """The local spec's TP = EP = 1 initial parameters (one rank)."""
    local = dataclasses.replace(run, spec="local", tp=1, sp=False, ep=1)
    initialize(local)
    return {n: p.detach().cpu() for n, p in build_model(local).named_parameters()}


def train(run: TeRun, full: dict[str, torch.Tensor]) -> dict:
    """``run.steps`` SGD steps (direct forward / backward, megatron's finalize_model_grads for
    the sequence-parallel norms); per step the loss and the unsharded gradients by local name."""
    initialize(run)
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from megatron_core.context_parallel import get_batch_on_this_cp_rank

    model = build_model(run)
    names = local_names(model, run)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(names))
    if missing:
        raise AssertionError(f"parameters without a local twin: {missing}")
    load(model, names, full)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(run.steps):
        optimizer.zero_grad()
        data = get_batch_on_this_cp_rank(batch(step)) if run.cp > 1 else batch(step)
        out = model(data["input_ids"], data["position_ids"], None, labels=data["labels"])
        # under CP each rank's mean over its tokens: finalize_model_grads averages the
        # gradients over the data x context ranks (equal token counts: the global mean's)
        loss = out.float().mean()
        loss.backward()
        finalize_model_grads([model])
        reported = loss.detach()
        if run.cp > 1:
            dist.all_reduce(reported, group=parallel_state.get_context_parallel_group())
            reported = reported / run.cp
        losses.append(reported.cpu())
        grads.append({names[n]: unshard(p, p.grad, names[n]) for n, p in params.items()})
        optimizer.step()
    final = {names[n]: unshard(p, p, names[n]) for n, p in params.items()}
    kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("TE")})
    return {"losses": losses, "grads": grads, "params": final, "te_modules": kinds}


def _fp8_extra_state() -> torch.Tensor:
    """A Transformer Engine >= 2.0 extra state with delayed-scaling FP8 metadata, as a GPU run
    with FP8 writes it (NOTE [ Extra state of Transformer Engine modules ], rule 3)."""
    import pickle

    from megatron_core.transformer_engine.common.recipe import DelayedScaling

    state = {
        "recipe": DelayedScaling(amax_history_len=4),
        "scale_fwd": torch.ones(3),
        "amax_history_fwd": torch.zeros(4, 3),
        "scale_bwd": torch.ones(2),
        "amax_history_bwd": torch.zeros(4, 2),
        "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True},
    }
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


FP8_MODULE = "decoder.layers.0.self_attention.linear_proj"


def save_checkpoint(run: TeRun, full: dict[str, torch.Tensor], directory: str) -> dict:
    """Save the TE-spec model with megatron-core's dist_checkpointing (one module carrying FP8
    metadata in its extra state); return the unsharded parameters and the extra-state keys."""
    import warnings

    initialize(run)
    from megatron.core import dist_checkpointing

    model = build_model(run)
    names = local_names(model, run)
    load(model, names, full)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the stand-in keeps FP8 metadata" (rule 3)
        model.get_submodule(FP8_MODULE).set_extra_state(_fp8_extra_state())
    sharded = model.sharded_state_dict()
    dist_checkpointing.save(sharded, directory)
    params = {names[n]: unshard(p, p, names[n]) for n, p in model.named_parameters()}
    return {
        "params": params,
        "extra": sorted(k for k in sharded if k.endswith("_extra_state")),
        "fp8 state": model.get_submodule(FP8_MODULE).get_extra_state().clone(),
    }


def load_checkpoint(run: TeRun, directory: str) -> dict:
    """Load it into a fresh TE-spec model (another seed) with strict load_state_dict."""
    import warnings

    initialize(dataclasses.replace(run, seed=run.seed + 1))
    from megatron.core import dist_checkpointing

    model = build_model(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = dist_checkpointing.load(model.sharded_state_dict(), directory)
        model.load_state_dict(state)
    names = local_names(model, run)
    params = {names[n]: unshard(p, p, names[n]) for n, p in model.named_parameters()}
    others = [
        v.numel()
        for k, v in model.state_dict().items()
        if k.endswith("_extra_state") and isinstance(v, torch.Tensor) and FP8_MODULE not in k
    ]
    return {
        "params": params,
        "fp8 state": model.get_submodule(FP8_MODULE).get_extra_state().clone(),
        "other extra states empty": all(size == 0 for size in others),
    }
