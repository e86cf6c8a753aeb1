"""megatron-core's DistributedDataParallel over this core at tp = 2 x dp = 2, via the switch.

megatron-core 0.16.1's DDP allocates its grad buffers on ``torch.cuda.current_device()``
(distributed/param_and_grad_buffer.py), so on a CPU-only torch the rank bodies run with that call
answering "cpu" (_megatron_gpt.cpu_only_cuda_calls); ``get_megatron_optimizer`` cannot run on a
CPU at all (its optimizers create tensors with ``device='cuda'``; README, porting), so the runs
step a torch SGD over DDP's ``main_grad`` (under ``use_distributed_optimizer``, after gathering
the reduce-scattered shards). Sequence parallelism is on, so finalize_model_grads'
tensor-parallel reduction meets DDP's buffers (with overlap_grad_reduce, still in flight).
"""

import dataclasses

import pytest
import torch

from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed

if megatron_core_version() is None:
    pytest.skip("megatron-core is not installed (the [megatron] extra)", allow_module_level=True)

from _megatron_ddp import DDPRun, train_ddp  # noqa: E402
from _megatron_gpt import Run, initial_state  # noqa: E402

TIMEOUT = 240
SHARDED = Run(tp=2, sp=True)


@pytest.fixture(scope="module")
def start():
    return run_distributed(initial_state, 1, Run(), timeout=TIMEOUT)[0]


def _check(actual: dict, expected: dict, exact: bool) -> None:
    # 1e-5: fp32 sums over TP shards and DP ranks in another order than one rank's.
    def same(a, b, what):
        if exact:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)

    same(torch.stack(actual["losses"]), torch.stack(expected["losses"]), "losses")
    for step, grads in enumerate(expected["grads"]):
        for name, grad in grads.items():
            same(actual["grads"][step][name], grad, f"step {step} main_grad of {name}")
    for name, param in expected["params"].items():
        same(actual["params"][name], param, f"final {name}")


@pytest.mark.parametrize(
    "overlap_grad_reduce, distributed_optimizer", [(False, False), (True, False), (True, True)]
)
def test_ddp_tp2_dp2_matches_tp1_dp1(start, overlap_grad_reduce, distributed_optimizer):
    # distributed_optimizer: DDP reduce-scatters the buckets (each DP rank reduces one shard);
    # the run all-gathers the shards before its torch step (_megatron_ddp._gather_reduced_shards).
    reference = run_distributed(train_ddp, 1, DDPRun(Run()), start, timeout=TIMEOUT)[0]
    ddp_run = DDPRun(SHARDED, distributed_optimizer, overlap_grad_reduce)
    per_rank = run_distributed(train_ddp, 4, ddp_run, start, timeout=TIMEOUT)
    for result in per_rank:
        _check(result, reference, exact=False)


def test_finalize_model_grads_with_ddp_chunks_is_megatron_cores(start):
    """Ours and megatron-core's own finalize_model_grads on the same DDP-wrapped chunks (both on
    this core's parallel_state): bitwise the same gradients and parameters."""
    ddp_run = DDPRun(SHARDED, overlap_grad_reduce=True)
    ours = run_distributed(train_ddp, 4, ddp_run, start, timeout=TIMEOUT)
    megatron_run = dataclasses.replace(ddp_run, megatron_finalize=True)
    theirs = run_distributed(train_ddp, 4, megatron_run, start, timeout=TIMEOUT)
    for rank, result in enumerate(ours):
        _check(result, theirs[rank], exact=True)
