"""megatron-core 0.19's HybridModel with its own ``hybrid_stack_spec`` (Transformer Engine
modules, served by the stand-in): attention and MLP layers (``*-*-``) at TP 2, and attention,
MLP and MoE layers (``*-E*``) at TP 2 with sequence parallelism, equal TP 1 from the same
weights (fp32, two SGD steps, 1e-5: sharded matmuls and their reductions sum in another
order); Mamba and GatedDeltaNet layers are refused naming the layer type and its CUDA-only
package. Bodies in ``_megatron_te_hybrid.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _megatron_te_hybrid import HybridRun, initial_state, refused, train

from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed

pytestmark = pytest.mark.requires_megatron_core
if not (megatron_core_version() or "").startswith("0.19."):
    pytest.skip(
        "HybridModel is megatron-core 0.19's (this lane has 0.16.1)", allow_module_level=True
    )

TIMEOUT = 300
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize(
    "pattern, sp",
    # megatron-core refuses MoE with TP in training without sequence parallelism
    [("*-*-", False), ("*-E*", True)],
)
def test_hybrid_model_at_tp2_equals_tp1(pattern, sp):
    run = HybridRun(pattern=pattern)
    start = run_distributed(initial_state, 1, run, timeout=TIMEOUT)[0]
    reference = run_distributed(train, 1, run, start, timeout=TIMEOUT)[0]
    assert "TELayerNormColumnParallelLinear" in reference["te_modules"]
    assert ("TEColumnParallelGroupedLinear" in reference["te_modules"]) == ("E" in pattern)
    tp2 = dataclasses.replace(run, tp=2, sp=sp)
    per_rank = run_distributed(train, 2, tp2, start, timeout=TIMEOUT)
    torch.testing.assert_close(
        torch.stack(per_rank[0]["losses"]), torch.stack(reference["losses"]), **TOL
    )
    for step, grads in enumerate(reference["grads"]):
        for name, grad in grads.items():
            got = per_rank[0]["grads"][step][name]
            torch.testing.assert_close(got, grad, **TOL, msg=f"step {step} {name}")
    for name, param in reference["params"].items():
        torch.testing.assert_close(per_rank[0]["params"][name], param, **TOL, msg=name)


@pytest.mark.parametrize(
    "pattern, layer, package",
    [("M*", "Mamba", "mamba-ssm"), ("*G", "GatedDeltaNet", "flash-linear-attention")],
)
def test_cuda_only_layer_types_are_refused_by_name(pattern, layer, package):
    message = run_distributed(refused, 1, pattern, timeout=TIMEOUT)[0]
    assert layer in message and package in message and "CUDA-only" in message, message
