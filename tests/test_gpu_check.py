"""scripts/checks/gpu_check.sh and its benchmark still start on a machine without a GPU: the
script's --dry-run finds and compiles every step's script, and the MLP benchmark's checks (each
mode against ours, ours against torch's nn.Linear), the recompute planner's check (predicted
against measured peaks) and the attention check (fused against unfused) pass on one CPU rank
at tiny sizes."""

import os
import subprocess
import sys

from megatron_core.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_finds_every_step_and_refuses_an_unknown_one():
    env = dict(os.environ, PYTHON=sys.executable)
    script = os.path.join(ROOT, "scripts", "checks", "gpu_check.sh")
    done = subprocess.run(
        ["bash", script, "--dry-run"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "steps bench_mlp attention tests checks train drift cp plan" in done.stdout
    bad = subprocess.run(
        ["bash", script, "--dry-run", "nosuchstep"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown step 'nosuchstep'" in bad.stderr


def _script_main_on_cpu(name: str, argv: list[str]) -> int:
    """``scripts/<room>/<script>.py``'s ``main(argv)`` on this rank, ``name`` being
    ``"<room>.<script>"`` (its exit status)."""
    import importlib

    sys.path.insert(0, ROOT)
    return importlib.import_module(f"scripts.{name}").main(argv)


def test_mlp_benchmark_verifies_its_modes_on_cpu():
    argv = ["--device", "cpu", "--hidden", "16", "--tokens", "8", "--iters", "1", "--gemm", "8"]
    name = "benchmarks.benchmark_mlp_cuda"
    assert run_distributed(_script_main_on_cpu, 1, name, argv, timeout=120) == [0]


def test_planner_check_runs_and_passes_on_cpu():
    argv = ["--device", "cpu", "--layers", "3", "--hidden", "32", "--seq", "64", "--batch", "2"]
    name = "checks.check_recompute_plan_cuda"
    assert run_distributed(_script_main_on_cpu, 1, name, argv, timeout=300) == [0]


def test_attention_check_runs_and_passes_on_cpu():
    argv = ["--device", "cpu", "--seq", "32", "--hidden", "64", "--layers", "1", "--iters", "1"]
    name = "checks.check_attention_cuda"
    assert run_distributed(_script_main_on_cpu, 1, name, argv, timeout=300) == [0]
