"""megatron-core's training step at tp = 2 x dp = 2 on this core (the switch) against tp = dp = 1.

Each run is the step megatron's trainer takes: megatron-core's GPTModel in its
DistributedDataParallel (with and without ``overlap_grad_reduce``), megatron-core's schedule API,
``finalize_model_grads`` and the optimizer ``get_megatron_optimizer`` builds (Adam, with and
without ``use_distributed_optimizer``; fp32 parameters, and bf16 parameters in megatron-core's
``Float16Module`` with fp32 main parameters). Sequence parallelism is on, so finalize_model_grads'
tensor-parallel reduction meets DDP's buffers (with overlap_grad_reduce, still in flight). No test
patches torch or megatron-core; the bodies live in tests/megatron/_megatron_ddp.py.
"""

import dataclasses

import pytest
import torch

from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed

if megatron_core_version() is None:
    pytest.skip("megatron-core is not installed (the [megatron] extra)", allow_module_level=True)

from _megatron_ddp import DDPRun, skip_where_gloo_carries_the_buckets, train_ddp  # noqa: E402
from _megatron_gpt import Run, initial_state  # noqa: E402

TIMEOUT = 240
SHARDED = Run(tp=2, sp=True)
LR = DDPRun(Run()).lr


@pytest.fixture(scope="module")
def start():
    return run_distributed(initial_state, 1, Run(), timeout=TIMEOUT)[0]


@pytest.fixture(scope="module")
def references(start):
    """The tp = dp = 1 run (no overlap, no distributed optimizer) per parameter dtype."""
    return {
        bf16: run_distributed(train_ddp, 1, DDPRun(Run(), bf16=bf16), start, timeout=TIMEOUT)[0]
        for bf16 in (False, True)
    }


def _check(actual: dict, expected: dict, exact: bool) -> None:
    """fp32 runs: losses, grad norms, every reduced gradient and final parameter equal, bitwise
    or to 1e-5 (the sharded matmuls and the all-reduces over TP shards and DP ranks sum in
    another order than one rank does)."""

    def same(a, b, what):
        if exact:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)

    same(torch.stack(actual["losses"]), torch.stack(expected["losses"]), "losses")
    same(torch.stack(actual["norms"]), torch.stack(expected["norms"]), "grad norms")
    for step, grads in enumerate(expected["grads"]):
        assert actual["grads"][step].keys() == grads.keys()
        for name, grad in grads.items():
            same(actual["grads"][step][name], grad, f"step {step} main_grad of {name}")
    assert actual["params"].keys() == expected["params"].keys()
    for name, param in expected["params"].items():
        same(actual["params"][name], param, f"final {name}")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check_bf16(actual: dict, expected: dict, start: dict) -> None:
    """bf16 runs against the bf16 run at tp = dp = 1. Elementwise 1e-5 cannot hold: the
    row-parallel all-reduce adds partial sums already rounded to bf16 (2^-8 relative) where one
    rank rounds the whole sum once, so the gradients differ by about 1% of their size, and
    Adam's first steps (about lr * sign(g)) turn a gradient within that noise of zero into a
    step of lr either way. The bounds are those of bf16 itself: the bf16 run at tp = dp = 1
    differs from the fp32 one by the same amounts (losses 1e-4, gradients 4% of their norm,
    parameters 7% of their movement, measured with this model)."""
    losses = torch.stack(actual["losses"])
    torch.testing.assert_close(losses, torch.stack(expected["losses"]), rtol=0, atol=1e-3)
    norms = torch.stack(actual["norms"])
    torch.testing.assert_close(norms, torch.stack(expected["norms"]), rtol=1e-2, atol=0)
    for step, grads in enumerate(expected["grads"]):
        for name, grad in grads.items():
            if grad.norm() > 0:
                off = _relative(actual["grads"][step][name], grad)
                assert off < 0.05, f"step {step} main_grad of {name}: {off:.3f} of its norm"
    # The fp32 main parameters: their distance from the reference, against how far the
    # reference moved them (a run that skipped its updates would be at 1.0).
    names = expected["params"].keys()
    assert actual["params"].keys() == names
    moved = torch.cat([(expected["params"][n] - start[n]).flatten() for n in names])
    off = torch.cat([(actual["params"][n] - expected["params"][n]).flatten() for n in names])
    assert (off.norm() / moved.norm()).item() < 0.15
    assert actual["rounded"]  # every bf16 parameter is its main parameter rounded


@pytest.mark.parametrize(
    "bf16, overlap_grad_reduce, distributed_optimizer",
    [
        (False, False, False),
        (False, True, False),
        (False, False, True),
        (False, True, True),
        (True, False, False),
        (True, True, True),
    ],
)
def test_training_step_tp2_dp2_matches_tp1_dp1(
    start, references, bf16, overlap_grad_reduce, distributed_optimizer
):
    skip_where_gloo_carries_the_buckets(4)
    reference = references[bf16]
    moved = max((reference["params"][n] - p).abs().max().item() for n, p in start.items())
    assert moved > 2 * LR  # three Adam steps of about lr each did move the weights
    ddp_run = DDPRun(SHARDED, distributed_optimizer, overlap_grad_reduce, bf16=bf16)
    per_rank = run_distributed(train_ddp, 4, ddp_run, start, timeout=TIMEOUT)
    for result in per_rank:
        if bf16:
            _check_bf16(result, reference, start)
        else:
            _check(result, reference, exact=False)


def test_finalize_model_grads_with_ddp_chunks_is_megatron_cores(start):
    """Ours and megatron-core's own finalize_model_grads on the same DDP-wrapped chunks (both on
    this core's parallel_state): bitwise the same gradients and parameters."""
    skip_where_gloo_carries_the_buckets(4)
    ddp_run = DDPRun(SHARDED, overlap_grad_reduce=True)
    ours = run_distributed(train_ddp, 4, ddp_run, start, timeout=TIMEOUT)
    megatron_run = dataclasses.replace(ddp_run, megatron_finalize=True)
    theirs = run_distributed(train_ddp, 4, megatron_run, start, timeout=TIMEOUT)
    for rank, result in enumerate(ours):
        _check(result, theirs[rank], exact=True)
