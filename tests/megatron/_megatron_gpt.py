"""Per-rank bodies for the megatron switch tests: megatron-core's own GPTModel on this core.

Imported by the rank processes of megatron_core.testing; every body installs the switch before it
imports megatron (workers are reused, so the install is idempotent). Nothing here patches torch or
megatron-core: on a torch without CUDA the switch's CPU mode (megatron_core/megatron/cpu_mode.py)
answers megatron-core's CUDA calls. Sizes are tiny: the tests compare runs, they do not measure
them.
"""

from __future__ import annotations

import dataclasses
import unittest.mock

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core import megatron as switch

VOCAB, SEQ, BATCH, HIDDEN, HEADS, LAYERS = 64, 8, 2, 16, 4, 2


@dataclasses.dataclass
class Run:
    """One training run's settings (picklable: it travels to the ranks)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallel: megatron-core's DotProductAttention through the switch
    sp: bool = False
    steps: int = 3
    dropout: float = 0.0
    recompute: str | None = None  # None, "full" (distribute_saved_activations) or "selective"
    # ("selective": core_attn, layernorm and mlp)
    moe: bool = False
    expert_bias: bool = False  # MoE router expert bias, updated in finalize_model_grads
    dispatcher: str = "allgather"  # MoE token dispatcher: "allgather" or "alltoall"
    microbatches: int = 1
    seed: int = 1234


def install() -> None:
    """Serve megatron.core's claimed modules from this package (before megatron is imported)."""
    switch.install()


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """What a user writes where megatron-core's local spec refuses sequence parallelism on CPU:
    its ``WrappedTorchNorm`` asserts "sequence parallel not supported by torch LayerNorm" (only
    apex's or Transformer Engine's norms take SP). A plain LayerNorm is right under SP as long as
    its parameters are marked ``sequence_parallel`` so finalize_model_grads sums their gradients
    over the tensor-parallel group."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def _layer_spec(run: Run):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=4 if run.moe else None, moe_grouped_gemm=False)
    if not run.sp:
        return spec
    spec.submodules.input_layernorm = SequenceParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    norm = SequenceParallelLayerNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * LAYERS, layer_norm=norm)


def config_of(run: Run):
    """megatron-core's TransformerConfig for ``run`` (CPU initialization, fp32)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if run.recompute == "full":
        extra = dict(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
            distribute_saved_activations=True,
        )
    elif run.recompute == "selective":
        # every module a dense local-spec layer recomputes: the MLP's checkpoint returns the
        # fc2 bias as is (added later), which must stay the parameter it is
        modules = ["core_attn", "layernorm", "mlp"]
        extra = dict(recompute_granularity="selective", recompute_modules=modules)
    if run.moe:
        extra.update(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type=run.dispatcher,
            moe_aux_loss_coeff=0.0,
            moe_router_enable_expert_bias=run.expert_bias,
            moe_router_bias_update_rate=0.01,
            moe_router_score_function="sigmoid" if run.expert_bias else "softmax",
            expert_model_parallel_size=run.ep,
        )
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=run.tp,
        pipeline_model_parallel_size=run.pp,
        context_parallel_size=run.cp,
        sequence_parallel=run.sp,
        hidden_dropout=run.dropout,
        attention_dropout=run.dropout,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        **extra,
    )


def build_model(run: Run, pre_process: bool = True, post_process: bool = True):
    """megatron-core's own GPTModel (local spec) for ``run`` on this rank."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config_of(run),
        transformer_layer_spec=_layer_spec(run),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
    )
    return model.to(device.current_device())  # a GPU user's model.cuda(); a no-op on CPU


def causal_mask() -> torch.Tensor:
    """The causal mask megatron-core takes (True = masked out), as a user would pass it."""
    return torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)


def batch(step: int, microbatch: int = 0) -> dict[str, torch.Tensor]:
    """The same tokens on every rank for (step, microbatch)."""
    gen = torch.Generator().manual_seed(1000 * step + microbatch)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device.current_device())
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand(BATCH, SEQ),
        # None: megatron-core makes the causal mask itself (with device="cuda", which the CPU
        # mode reads as the CPU; tests/megatron/test_megatron_cpu_mode_gpt.py checks it is the
        # explicit one).
        "attention_mask": None,
    }


def initialize(run: Run) -> None:
    """parallel_state and the RNG streams for ``run`` (the switch's modules are ours)."""
    install()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=run.tp,
        pipeline_model_parallel_size=run.pp,
        expert_model_parallel_size=run.ep,
        context_parallel_size=run.cp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(run.seed)


def full_tensor(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the param's value or grad) gathered over the TP group where it is sharded,
    as a CPU tensor (results travel to the test process and meet CPU references there)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().cpu().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    if getattr(param, "allreduce", True) is False:  # expert weights: expert-TP group
        group = parallel_state.get_expert_tensor_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim).cpu()


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slice of the unsharded ``full`` state into ``model``."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = full[name]
            if getattr(param, "tensor_model_parallel", False):
                value = value.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            param.copy_(value)


def _layer_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> its name at pp = ep = 1 (stages number their layers from 0, expert
    ranks their local experts)."""
    from megatron.core import parallel_state

    names = {}
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            layer = layers[int(parts[2])]
            parts[2] = str(layer.layer_number - 1)
            if "local_experts" in parts:
                at = parts.index("local_experts") + 1
                per_rank = len(layer.mlp.experts.local_experts)
                parts[at] = str(ep_rank * per_rank + int(parts[at]))
        names[name] = ".".join(parts)
    return names


def _forward_step(data_iterator, model):
    data = next(data_iterator)
    output = model(
        data["input_ids"], data["position_ids"], data["attention_mask"], labels=data["labels"]
    )

    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()

    def loss_func(output_tensor):
        # megatron-core's convention under CP: its schedule multiplies the loss by the CP size
        # and its gradient reduction averages over data x context ranks, so a rank returns its
        # tokens' share of the global mean (here: its sum over every rank's equal token count)
        loss = output_tensor.float().sum() / (output_tensor.numel() * cp)
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _cut(data: dict, run: Run) -> dict:
    """This context-parallel rank's part of a batch (the load-balanced split)."""
    if run.cp == 1:
        return data
    from megatron_core.context_parallel import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(data)


def train(run: Run, full: dict[str, torch.Tensor] | None) -> dict:
    """``run.steps`` SGD steps of megatron-core's GPTModel through megatron-core's schedule API.

    Returns the losses (last stage), and per step the unsharded gradients of this rank's
    parameters under their pp = 1 names, and the unsharded final parameters.
    """
    initialize(run)
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_model(
        run,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    if full is not None:
        load_full(model, {n: full[g] for n, g in _layer_names(model).items() if g in full})
    names = _layer_names(model)
    # SGD: a linear step keeps fp32 summation-order differences at their size (Adam's
    # normalization would blow up those of near-zero gradients).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    from megatron_core import tensor_parallel  # served as megatron.core.tensor_parallel

    # Count the checkpoints megatron-core's block / attention take through this package.
    counted = unittest.mock.patch.object(
        tensor_parallel, "checkpoint", wraps=tensor_parallel.checkpoint
    )
    for step in range(run.steps):
        optimizer.zero_grad()
        data = iter([_cut(batch(step, m), run) for m in range(run.microbatches)])
        with counted as checkpoint:
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=data,
                model=[model],
                num_microbatches=run.microbatches,
                seq_length=SEQ,
                micro_batch_size=BATCH,
                forward_only=False,
            )
        if reports:
            loss = torch.stack([r["loss"] for r in reports]).mean()
            if run.cp > 1:  # each CP rank's share of the global mean: their sum is the mean
                dist.all_reduce(loss, group=parallel_state.get_context_parallel_group())
            losses.append(loss.cpu())
        grads.append({names[n]: full_tensor(p, p.grad) for n, p in model.named_parameters()})
        optimizer.step()
    params = {names[n]: full_tensor(p, p) for n, p in model.named_parameters()}
    params.update({names[n]: b.cpu() for n, b in model.named_buffers() if "expert_bias" in n})
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "checkpoints": checkpoint.call_count,
    }


def initial_state(run: Run) -> dict[str, torch.Tensor]:
    """The unsharded initial parameters of ``run``'s model at tp = pp = 1 (one rank)."""
    initialize(dataclasses.replace(run, tp=1, pp=1, ep=1, sp=False))
    model = build_model(dataclasses.replace(run, tp=1, pp=1, ep=1, sp=False))
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def save_checkpoint(run: Run, full: dict[str, torch.Tensor], directory: str) -> dict:
    """Save megatron-core's GPTModel with megatron-core's dist_checkpointing; return the
    unsharded parameters that were saved."""
    initialize(run)
    from megatron.core import dist_checkpointing

    model = build_model(run)
    names = _layer_names(model)
    load_full(model, {n: full[g] for n, g in names.items() if g in full})
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return {names[n]: full_tensor(p, p) for n, p in model.named_parameters()}


def load_checkpoint(run: Run, directory: str) -> dict:
    """Load the checkpoint into a fresh model of ``run`` (another seed, so nothing matches by
    accident); return its unsharded parameters."""
    initialize(dataclasses.replace(run, seed=run.seed + 1))
    from megatron.core import dist_checkpointing

    model = build_model(run)
    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state)
    names = _layer_names(model)
    return {names[n]: full_tensor(p, p) for n, p in model.named_parameters()}


def replica_spread(model: torch.nn.Module, group) -> dict[str, bool]:
    """Parameter name -> whether this replicated (not TP-sharded) parameter is bitwise the same
    on every rank of ``group``."""
    same = {}
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            continue
        parts = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, param.detach().contiguous(), group=group)
        same[name] = all(torch.equal(part, parts[0]) for part in parts)
    return same


def rank0_data_path_draw(tp_rank: int) -> None:
    """What Megatron-LM's data path draws on TP rank 0 only (pretrain_gpt builds the data
    iterator there and broadcasts batches): a shuffling DataLoader's iterator takes its seed from
    the CPU generator."""
    if tp_rank == 0:
        next(iter(torch.utils.data.DataLoader(range(4), shuffle=True)))


def replicas_after_host_draws(run: Run, apart: bool) -> dict[str, bool]:
    """``run.steps`` SGD steps of megatron-core's GPTModel, direct forward and backward, with a
    host draw on TP rank 0 before each; returns :func:`replica_spread` of the result. With
    ``apart=False`` the CPU generator serves dropout too (the device stream is not kept apart:
    NOTE [ RNG streams ], rule 6), which is how the replicas drift."""
    initialize(run)
    from megatron.core import parallel_state

    from megatron_core.tensor_parallel.random import keep_device_stream_apart

    if not apart:
        keep_device_stream_apart(False)
    model = build_model(run)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for step in range(run.steps):
        rank0_data_path_draw(tp_rank)
        data = batch(step)
        optimizer.zero_grad()
        output = model(
            data["input_ids"], data["position_ids"], data["attention_mask"], labels=data["labels"]
        )
        output.float().mean().backward()
        optimizer.step()
    return replica_spread(model, parallel_state.get_tensor_model_parallel_group())
