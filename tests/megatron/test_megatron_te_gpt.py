"""megatron-core's GPTModel with its Transformer Engine layer spec on the stand-in equals the
same model built with the local spec, from the same weights under Transformer Engine's names.

GQA + RoPE (through the stand-in's fused RoPE) + SwiGLU + RMSNorm, no biases, fp32: losses and
every gradient of two SGD steps, and the final parameters, within 1e-5 relative (atol 1e-6):
the layers compute the same products, summed in other orders (fused norm + GEMM, sharded
matmuls and their reductions, the attention core's kernel). At TP 1 and 2, with and without
sequence parallelism (against the local spec without it, which refuses SP without apex), and at
CP 2 (the stand-in's DotProductAttention over ``context_parallel``, no adapter). MoE:
the TE spec's GroupedLinear experts equal the local spec's SequentialMLP, at EP 1 and 2.
Bodies in ``_megatron_te_gpt.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _megatron_te_gpt import TeRun, initial_state, train

from megatron_core.testing import run_distributed

pytestmark = pytest.mark.requires_megatron_core
TIMEOUT = 300
TOL = {"rtol": 1e-5, "atol": 1e-6}
DENSE, MOE = TeRun(), TeRun(moe=True)


@pytest.fixture(scope="module")
def dense_start():
    return run_distributed(initial_state, 1, DENSE, timeout=TIMEOUT)[0]


@pytest.fixture(scope="module")
def dense_local(dense_start):
    return run_distributed(train, 1, dataclasses.replace(DENSE, spec="local"), dense_start,
                           timeout=TIMEOUT)[0]  # fmt: skip


def assert_equal_runs(expected: dict, per_rank: list[dict]) -> None:
    torch.testing.assert_close(
        torch.stack(per_rank[0]["losses"]), torch.stack(expected["losses"]), **TOL
    )
    for step, grads in enumerate(expected["grads"]):
        merged = {n: g for rank in per_rank for n, g in rank["grads"][step].items()}
        assert merged.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(merged[name], grad, **TOL, msg=f"step {step} {name}")
    merged = {n: p for rank in per_rank for n, p in rank["params"].items()}
    for name, param in expected["params"].items():
        torch.testing.assert_close(merged[name], param, **TOL, msg=f"final {name}")


@pytest.mark.parametrize("tp, sp, cp", [(1, False, 1), (2, False, 1), (2, True, 1), (1, False, 2)])
def test_te_spec_equals_local_spec(tp, sp, cp, dense_start, dense_local):
    run = dataclasses.replace(DENSE, tp=tp, sp=sp, cp=cp)
    per_rank = run_distributed(train, tp * cp, run, dense_start, timeout=TIMEOUT)
    assert per_rank[0]["te_modules"] == [
        "TEDotProductAttention",
        "TELayerNormColumnParallelLinear",
        "TERowParallelLinear",
    ]
    assert_equal_runs(dense_local, per_rank)


@pytest.mark.parametrize("ep", [1, 2])
def test_grouped_linear_experts_equal_sequential_mlp(ep):
    start = run_distributed(initial_state, 1, MOE, timeout=TIMEOUT)[0]
    local = run_distributed(train, 1, dataclasses.replace(MOE, spec="local"), start,
                            timeout=TIMEOUT)[0]  # fmt: skip
    per_rank = run_distributed(train, ep, dataclasses.replace(MOE, ep=ep), start, timeout=TIMEOUT)
    assert "TEColumnParallelGroupedLinear" in per_rank[0]["te_modules"]
    assert_equal_runs(local, per_rank)
