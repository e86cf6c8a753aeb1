"""The switch's CPU mode end to end: megatron-core's CUDA-only code on gloo CPU ranks.

No test here patches anything: megatron-core's ``GPTModel`` builds its default causal mask with
``device="cuda"`` (transformer/utils.py ``get_default_causal_mask``), its
``DistributedDataParallel`` allocates its grad buffers on ``torch.cuda.current_device()``, its
``get_megatron_optimizer`` makes the optimizers' tensors with ``device='cuda'``, and
``dist_checkpointing.save``'s writer calls ``torch.cuda.synchronize()`` and makes a tensor on
``torch.cuda.current_device()``. With the CPU mode on (the default without CUDA) they run as they
are, and so does the README's example (scripts/megatron_gpt_example.py), written as for a GPU.
The rank bodies live in tests/megatron/_megatron_cpu_mode.py.
"""

import dataclasses

import pytest
import torch

from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed

if megatron_core_version() is None:  # checked without importing megatron in the test process
    pytest.skip("megatron-core is not installed (the [megatron] extra)", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("auto mode keeps the CPU mode off where CUDA is there", allow_module_level=True)

from _megatron_cpu_mode import (  # noqa: E402
    checkpoint_round_trip,
    gpt_loss,
    initial_state,
    megatron_adam_step,
)
from _megatron_gpt import Run  # noqa: E402

TIMEOUT = 240
ONE = Run(steps=1)
TWO = dataclasses.replace(ONE, tp=2)
LR = 1e-3


@pytest.fixture(scope="module")
def start():
    return run_distributed(initial_state, 1, ONE, timeout=TIMEOUT)[0]


def test_gpt_default_causal_mask_is_the_explicit_one(start):
    # The same computation with the mask made by megatron-core (on "cuda", i.e. the CPU) and
    # with the mask a CPU user passed before: bitwise equal.
    explicit = run_distributed(gpt_loss, 1, ONE, start, False, timeout=TIMEOUT)[0]
    default = run_distributed(gpt_loss, 1, ONE, start, True, timeout=TIMEOUT)[0]
    assert torch.equal(default, explicit)


def test_gpt_default_causal_mask_tensor_parallel_2_matches_1(start):
    reference = run_distributed(gpt_loss, 1, ONE, start, False, timeout=TIMEOUT)[0]
    per_rank = run_distributed(gpt_loss, 2, TWO, start, True, timeout=TIMEOUT)
    # 1e-5: sharded matmuls and the all-reduces sum in another order in fp32.
    for loss in per_rank:
        torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)


def test_get_megatron_optimizer_adam_step_tensor_parallel_2_matches_1(start):
    reference = run_distributed(megatron_adam_step, 1, ONE, start, LR, timeout=TIMEOUT)[0]
    per_rank = run_distributed(megatron_adam_step, 2, TWO, start, LR, timeout=TIMEOUT)
    assert reference["updated"] and all(rank["updated"] for rank in per_rank)
    moved = max((reference["params"][n] - p).abs().max().item() for n, p in start.items())
    assert moved > LR / 2  # the step did move the weights (Adam's first step is about lr)
    for rank in per_rank:
        torch.testing.assert_close(rank["loss"], reference["loss"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            torch.as_tensor(rank["grad_norm"]), torch.as_tensor(reference["grad_norm"])
        )
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
        for name, param in reference["params"].items():
            torch.testing.assert_close(rank["params"][name], param, rtol=1e-5, atol=1e-5, msg=name)


def test_dist_checkpointing_save_at_tensor_parallel_2_loads_bitwise(start, tmp_path):
    per_rank = run_distributed(checkpoint_round_trip, 2, TWO, start, str(tmp_path), timeout=TIMEOUT)
    for rank in per_rank:
        assert rank["differed"]  # the fresh model had other weights before the load
        assert rank["params"].keys() == start.keys()
        for name, param in start.items():
            assert torch.equal(rank["params"][name], param), name


def test_readme_example_trains_with_megatron_cores_own_step():
    # scripts/megatron_gpt_example.py as the README runs it (torchrun, two ranks; --standalone
    # picks a free port): megatron-core's code written for a GPU (init_process_group("nccl"),
    # .cuda(), DDP, get_megatron_optimizer).
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_CORE_")}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(root, "scripts", "megatron_gpt_example.py")],
        capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=root,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, result.stdout
