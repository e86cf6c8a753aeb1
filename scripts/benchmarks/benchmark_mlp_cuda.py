"""ColumnParallelLinear -> GELU -> RowParallelLinear forward + backward on one GPU, in bf16.

Run (one GPU, NCCL at world size 1; the layers' collectives are identities at TP = 1)::

    torchrun --standalone --nproc_per_node=1 scripts/benchmarks/benchmark_mlp_cuda.py
    python scripts/benchmarks/benchmark_mlp_cuda.py --device cpu --hidden 64 --tokens 64 \
        --iters 2  # dry run

For each ``--hidden`` H (FFN 4H, ``--tokens`` T as [T/2, 2, H], bf16 weights and input) every
mode below runs one training step (forward, ``out.float().sum().backward()``, gradients dropped)
per round, in an order rotated from round to round; reported are the median step time (CUDA
events), the model TFLOP/s (12 T H F FLOPs: the forward's two GEMMs and the backward's four; a
recompute's extra forward is not counted) and that rate as a fraction of the measured bf16 GEMM
peak (an 8192^3 ``torch.matmul``, median of the same number of repeats), and the allocator's
peak during the step above what was allocated before it (``torch.cuda.max_memory_allocated``)
and what the forward left allocated for backward. Modes:

    torch nn.Linear          torch.nn.Linear -> gelu -> torch.nn.Linear, the same weights
    ours                     ColumnParallelLinear -> gelu -> RowParallelLinear
    ours + torch ckpt        torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)
    ours + ckpt              tensor_parallel.checkpoint(mlp, False, x, use_reentrant=False)
    ours + ckpt reentrant    tensor_parallel.checkpoint(mlp, False, x) (megatron-core's default)
    ours + ckpt distributed  tensor_parallel.checkpoint(mlp, True, x): distribute_saved_activations
                             (at TP = 1 the split is the identity: this times its bookkeeping)
    ours, checks always      "ours" with every collective agreed (CheckMode.ALWAYS)
    ours, checks off         "ours" with MEGATRON_CORE_CHECK_CONSISTENCY=0 (CheckMode.OFF)

Before timing, each mode's output and input gradient are compared with "ours" (checkpointed
modes: bitwise) and "ours" with "torch nn.Linear" (bf16: relative error under 2e-2); a mismatch
exits with status 1. The last lines are a markdown table per hidden size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import checkpoint as torch_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_core import consistency, device  # noqa: E402
from megatron_core import parallel_state as ps  # noqa: E402
from megatron_core import tensor_parallel as tp  # noqa: E402
from megatron_core.consistency import CheckMode  # noqa: E402
from megatron_core.model_parallel_config import ModelParallelConfig  # noqa: E402

MODES = (
    "torch nn.Linear",
    "ours",
    "ours + torch ckpt",
    "ours + ckpt",
    "ours + ckpt reentrant",
    "ours + ckpt distributed",
    "ours, checks always",
    "ours, checks off",
)


class _Ours(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = ModelParallelConfig(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(), params_dtype=dtype
        )
        init = torch.nn.init.xavier_normal_
        self.fc1 = tp.ColumnParallelLinear(hidden, ffn, config=cfg, init_method=init)
        self.fc2 = tp.RowParallelLinear(
            ffn, hidden, config=cfg, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        out, _ = self.fc2(F.gelu(h))
        return out


class _Torch(torch.nn.Module):
    def __init__(self, ours: _Ours) -> None:
        super().__init__()
        w1, w2 = ours.fc1.weight, ours.fc2.weight
        self.fc1 = torch.nn.Linear(w1.shape[1], w1.shape[0], device=w1.device, dtype=w1.dtype)
        self.fc2 = torch.nn.Linear(w2.shape[1], w2.shape[0], device=w2.device, dtype=w2.dtype)
        with torch.no_grad():
            self.fc1.weight.copy_(w1)
            self.fc1.bias.copy_(ours.fc1.bias)
            self.fc2.weight.copy_(w2)
            self.fc2.bias.copy_(ours.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _forward(mode: str, ours: _Ours, ref: _Torch, x: torch.Tensor) -> torch.Tensor:
    if mode == "torch nn.Linear":
        return ref(x)
    if mode == "ours + torch ckpt":
        return torch_checkpoint.checkpoint(ours, x, use_reentrant=False)
    if mode == "ours + ckpt":
        return tp.checkpoint(ours, False, x, use_reentrant=False)
    if mode == "ours + ckpt reentrant":
        return tp.checkpoint(ours, False, x)
    if mode == "ours + ckpt distributed":
        return tp.checkpoint(ours, True, x)
    return ours(x)


def _check_mode(mode: str) -> CheckMode:
    if mode == "ours, checks always":
        return CheckMode.ALWAYS
    if mode == "ours, checks off":
        return CheckMode.OFF
    return consistency.mode()


class _Timer:
    """Elapsed milliseconds of a region: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self) -> None:
        self.cuda = device.device_type() == "cuda"

    def __enter__(self) -> _Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(True), torch.cuda.Event(True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def _step(mode: str, ours: _Ours, ref: _Torch, x0: torch.Tensor, keep: bool = False):
    x = x0.detach().requires_grad_()
    previous = consistency.set_mode(_check_mode(mode), restart_windows=False)
    try:
        out = _forward(mode, ours, ref, x)
        out.float().sum().backward()
    finally:
        consistency.set_mode(previous, restart_windows=False)
    result = (out.detach(), x.grad) if keep else None
    for p in list(ours.parameters()) + list(ref.parameters()):
        p.grad = None
    return result


def _memory(mode: str, ours: _Ours, ref: _Torch, x0: torch.Tensor) -> tuple[float, float]:
    """(peak above the start, left for backward after the forward) in MiB; 0s on a CPU."""
    if device.device_type() != "cuda":
        return 0.0, 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    x = x0.detach().requires_grad_()
    out = _forward(mode, ours, ref, x)
    saved = torch.cuda.memory_allocated() - base
    out.float().sum().backward()
    del out
    for p in list(ours.parameters()) + list(ref.parameters()):
        p.grad = None
    peak = torch.cuda.max_memory_allocated() - base
    return peak / 2**20, saved / 2**20


def _gemm_peak(n: int, iters: int, dtype: torch.dtype) -> float:
    """Measured TFLOP/s of an n^3 matmul (random inputs; median of ``iters``)."""
    dev = device.current_device()
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(iters):
        with _Timer() as t:
            torch.matmul(a, b)
        times.append(t.ms)
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _verify(ours: _Ours, ref: _Torch, x0: torch.Tensor) -> list[str]:
    base_out, base_grad = _step("ours", ours, ref, x0, keep=True)
    problems = []
    for mode in MODES:
        out, grad = _step(mode, ours, ref, x0, keep=True)
        if mode == "torch nn.Linear":
            errors = (_rel(base_out, out), _rel(base_grad, grad))
            if max(errors) > 2e-2 or not all(e == e for e in errors):
                problems.append(f"{mode}: relative error {errors} against ours")
        elif not (torch.equal(out, base_out) and torch.equal(grad, base_grad)):
            problems.append(
                f"{mode}: not bitwise equal to ours (out {_rel(out, base_out):.2e}, "
                f"grad {_rel(grad, base_grad):.2e})"
            )
    return problems


def run(hidden: int, args) -> tuple[str, list[str]]:
    """Verify and time every mode at one hidden size; (markdown table, problems)."""
    dtype = torch.bfloat16
    ffn, tokens = 4 * hidden, args.tokens
    tp.model_parallel_cuda_manual_seed(1234)
    ours = _Ours(hidden, ffn, dtype).to(device.current_device())
    ref = _Torch(ours)
    x0 = torch.randn(tokens // 2, 2, hidden, device=device.current_device(), dtype=dtype)
    problems = _verify(ours, ref, x0)
    for mode in MODES:  # warm-up
        _step(mode, ours, ref, x0)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.iters):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            with _Timer() as t:
                _step(mode, ours, ref, x0)
            times[mode].append(t.ms)
    flops = 12 * tokens * hidden * ffn
    peak = args.peak_tflops
    rows = [
        f"hidden {hidden}, ffn {ffn}, tokens {tokens}, bf16, {args.iters} rounds, "
        f"{_describe_device()}, measured bf16 GEMM peak {peak:.0f} TFLOP/s",
        "",
        "| mode | median step (ms) | / ours | model TFLOP/s | of GEMM peak | "
        "peak above start (MiB) | kept for backward (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = statistics.median(times["ours"])
    for mode in MODES:
        ms = statistics.median(times[mode])
        rate = flops / (ms * 1e-3) / 1e12
        mem_peak, saved = _memory(mode, ours, ref, x0)
        rows.append(
            f"| {mode} | {ms:.3f} | {ms / base:.3f} | {rate:.0f} | {rate / peak:.2f} | "
            f"{mem_peak:.0f} | {saved:.0f} |"
        )
    return "\n".join(rows), problems


def _describe_device() -> str:
    if device.device_type() == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"cpu, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, start a one-rank group if none is running, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--hidden", default="4096,8192", help="comma-separated hidden sizes")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20, help="timed rounds per mode")
    parser.add_argument("--gemm", type=int, default=8192, help="size of the peak GEMM")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.tokens % 2:
        parser.error(f"--tokens ({args.tokens}) must be even and positive")
    hiddens = [int(h) for h in args.hidden.split(",")]
    if min(hiddens) < 1:
        parser.error(f"--hidden ({args.hidden}) must hold positive sizes")
    device.set_device_type(args.device)
    device.set_current_device(int(os.environ.get("LOCAL_RANK", "0")))
    started = not dist.is_initialized()
    if started:
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(device.default_backend())
        else:
            store = os.path.join(tempfile.mkdtemp(), "rendezvous")
            dist.init_process_group(
                device.default_backend(), init_method=f"file://{store}", rank=0, world_size=1
            )
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    args.peak_tflops = _gemm_peak(args.gemm, max(args.iters, 3), torch.bfloat16)
    failed = False
    try:
        for hidden in hiddens:
            table, problems = run(hidden, args)
            if dist.get_rank() == 0:
                print(table + "\n", flush=True)
                for problem in problems:
                    print("MISMATCH", problem, flush=True)
            failed = failed or bool(problems)
    finally:
        ps.destroy_model_parallel()
        if started:
            dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
