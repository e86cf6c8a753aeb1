"""Selective recompute on the GPT (recompute_granularity="selective", recompute_modules).

Every mode must be bitwise equal to no recompute (torch.equal): on the CPU a recompute runs the
same kernels on the same values with the replayed RNG states, so any difference, even in the
last bit, is a bug. Dropout is on (hidden and attention), so the RNG replay of the default stream
and of the tracker fork is exercised. TP = world size 1, 2, 4; sequence parallelism at 2 and 4.
"""

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_core.tensor_parallel.recompute.memory import count_saved_activations
from megatron_core.testing import run_distributed
from megatron_core.transformer import GPTModel, TransformerConfig

SHAPE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
VOCAB, SEQ, BATCH = 64, 16, 2
MODULES = {
    "core_attn": ["core_attn"],
    "mlp": ["mlp"],
    "layernorm": ["layernorm"],
    "activation": ["activation"],
    "all": ["core_attn", "mlp", "layernorm", "activation"],
    "layernorm + activation": ["layernorm", "activation"],
}


def _config(tp, sp, modules):
    selective = {} if modules is None else {"recompute_granularity": "selective"}
    return TransformerConfig(
        **SHAPE,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        hidden_dropout=0.2,
        attention_dropout=0.2,
        recompute_modules=modules,
        **selective,
    )


def _step(tp, sp, modules):
    model_parallel_cuda_manual_seed(5)
    model = GPTModel(_config(tp, sp, modules), VOCAB, SEQ)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    with count_saved_activations(ignore=model.parameters()) as report:
        loss = model(tokens, labels).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, torch.rand(3), report.total_bytes


def _body(sp):
    tp = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    want_loss, want_grads, want_draw, _ = _step(tp, sp, None)
    problems = []
    for name, modules in MODULES.items():
        loss, grads, draw, _ = _step(tp, sp, modules)
        if not torch.equal(loss, want_loss):
            problems.append(f"{name}: loss differs")
        problems += [
            f"{name}: grad of {n} differs"
            for n, g in grads.items()
            if not torch.equal(g, want_grads[n])
        ]
        if not torch.equal(draw, want_draw):
            problems.append(f"{name}: the RNG after backward differs")
    return problems


@pytest.mark.parametrize(
    "world_size, sp", [(1, False), (2, False), (4, False), (2, True), (4, True)]
)
def test_every_selective_mode_is_bitwise_equal_to_no_recompute(world_size, sp):
    for rank, problems in enumerate(run_distributed(_body, world_size, sp, timeout=240)):
        assert problems == [], f"rank {rank}: {problems}"


def test_recompute_modules_names_and_errors():
    assert TransformerConfig(**SHAPE).recompute_modules == ["core_attn"]  # megatron-core default
    for name, what in (("moe_act", "MoE experts"), ("mla_up_proj", "multi-latent attention")):
        with pytest.raises(MegatronCoreError, match=f"entry '{name}' needs {what}"):
            TransformerConfig(**SHAPE, recompute_granularity="selective", recompute_modules=[name])
    with pytest.raises(MegatronCoreError, match="entry 'gelu' is not one of"):
        TransformerConfig(**SHAPE, recompute_granularity="selective", recompute_modules=["gelu"])
    with pytest.raises(MegatronCoreError, match="must be a list of names"):
        TransformerConfig(**SHAPE, recompute_granularity="selective", recompute_modules="mlp")
