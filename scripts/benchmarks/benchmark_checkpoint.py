"""Step time and memory of every checkpoint mode, side by side in one run on one model.

Run::

    python scripts/benchmarks/benchmark_checkpoint.py                       # cpu, tp=2 gloo ranks
    python scripts/benchmarks/benchmark_checkpoint.py --tp 1 --layers 8 --seq 512 --hidden 512
    torchrun --nproc_per_node=1 scripts/benchmarks/benchmark_checkpoint.py --device cuda --tp 1 \
        --seq 2048 --batch 4 --hidden 2048 --heads 16 --dtype bf16

A stack of ``--layers`` GPT layers (``megatron_core.transformer.TransformerLayer``, dropout on)
runs forward + backward with each layer checkpointed in one of these modes:

    none                  no checkpoint
    torch reentrant       torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
    torch non-reentrant   torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    ours reentrant        tensor_parallel.checkpoint(layer, False, x)           (megatron's call)
    ours non-reentrant    tensor_parallel.checkpoint(layer, False, x, use_reentrant=False)
    ours distributed      tensor_parallel.checkpoint(layer, True, x)            (input split 1/tp)
    ours offloaded        tensor_parallel.checkpoint(layer, False, x, offload_to_cpu=True)
    ours selective        core attention only (recompute_granularity="selective")

Every repetition runs every mode (``--iters`` steps each, the order rotated from one repetition to
the next), so a slow spell of a shared machine hits all modes alike. Reported per mode: the
median step time over ``--reps`` repetitions with its min-max spread, and the medians (with
spread) of the per-repetition ratios to "none" and to "torch non-reentrant", i.e. ratios of steps
timed next to each other. With tp > 1 a repetition's time is the slowest rank's.

Memory, from one extra step per mode: "kept" is what autograd keeps for backward after the
forward of the stack (``tensor_parallel.count_saved_activations``, parameters excluded; for the
checkpoint modes: the layers' inputs); on an accelerator also "held" (allocated after forward
minus before) and "peak" (peak allocated during forward + backward minus before).

torch's checkpoint replays the CPU and device generators but not the RNG tracker's streams, so its
recomputed attention-dropout masks differ from the forward's (its gradients are not the model's;
the work, and so the timing, is the same). The RNG fork microbenchmark of
scripts/benchmarks/benchmark_rng_fork.py runs at the end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from megatron_core import device, parallel_state
from megatron_core.tensor_parallel import (
    capture_saved_inputs,
    checkpoint,
    count_saved_activations,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_core.transformer import TransformerConfig, TransformerLayer

MODES: dict[str, Callable | None] = {
    "none": None,
    "torch reentrant": lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=True),
    "torch non-reentrant": lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False),
    "ours reentrant": lambda f, x: checkpoint(f, False, x),
    "ours non-reentrant": lambda f, x: checkpoint(f, False, x, use_reentrant=False),
    "ours distributed": lambda f, x: checkpoint(f, True, x),
    "ours offloaded": lambda f, x: checkpoint(f, False, x, offload_to_cpu=True),
    "ours selective": None,  # see _select
}
BASELINES = ("none", "torch non-reentrant")


def _build(args) -> tuple[torch.nn.ModuleList, torch.Tensor]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
    )
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    layers = torch.nn.ModuleList(TransformerLayer(config) for _ in range(args.layers))
    x = torch.randn(args.seq, args.batch, args.hidden, device=device.current_device(), dtype=dtype)
    return layers, x.requires_grad_()


def _select(layers, on: bool) -> None:
    """Switch selective recompute (the core attention in a checkpoint) on or off in place."""
    for layer in layers:
        if not hasattr(layer.self_attention, "checkpoint_core_attention"):
            raise RuntimeError("ParallelAttention has no checkpoint_core_attention switch")
        layer.self_attention.checkpoint_core_attention = on


def _forward(layers, x: torch.Tensor, mode: str) -> torch.Tensor:
    wrap = MODES[mode]
    _select(layers, mode == "ours selective")
    for layer in layers:
        x = layer(x) if wrap is None else wrap(layer, x)
    return x


def _step(layers, x: torch.Tensor, mode: str) -> None:
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    _forward(layers, x, mode).float().square().mean().backward()


def _timed_step(layers, x, mode: str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step; wall from device events on an
    accelerator. CPU seconds exclude the time a shared machine runs other processes."""
    device.synchronize()
    cpu = time.process_time()
    if device.is_accelerator():
        start, end = (torch.Event(device=device.current_device(), enable_timing=True) for _ in "se")
        start.record()
        _step(layers, x, mode)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, time.process_time() - cpu
    began = time.perf_counter()
    _step(layers, x, mode)
    return time.perf_counter() - began, time.process_time() - cpu


def _slowest_rank(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device.current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return t.tolist()


def _memory(layers, x, mode: str) -> dict[str, int | None]:
    """kept / held / peak bytes of one step (module doc); held and peak are None on the CPU."""
    params = list(layers.parameters())
    device.synchronize()
    before = device.memory_allocated()
    device.reset_peak_memory_stats()
    with count_saved_activations(ignore=params) as report, capture_saved_inputs() as found:
        out = _forward(layers, x, mode)
    device.synchronize()
    held = device.memory_allocated() - before
    inputs = [s.nbytes() for s in found if any(slot.split for slot in s.slots)]
    out.float().square().mean().backward()
    device.synchronize()
    peak = device.max_memory_allocated() - before
    accel = device.is_accelerator()
    return {
        "kept": report.total_bytes,
        "held": held if accel else None,
        "peak": peak if accel else None,
        "split_input": inputs[0] if inputs else None,
    }


def measure_rank(args) -> dict:
    """Per-rank body: warm-up, timed repetitions, one memory step per mode.

    A repetition runs ``iters`` rounds of one step of every mode (order rotated per round), so
    the modes of a repetition share the same stretch of machine time.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    layers, x = _build(args)
    modes = list(MODES)
    for mode in modes:  # warm-up: allocator, kernels, the first call of every code path
        _step(layers, x, mode)
    times = {clock: {mode: [] for mode in modes} for clock in ("wall", "cpu")}
    rounds = 0
    for _ in range(args.reps):
        sums = {mode: [0.0, 0.0] for mode in modes}
        for _ in range(args.iters):
            shift = rounds % len(modes)
            rounds += 1
            for mode in modes[shift:] + modes[:shift]:
                wall, cpu = _timed_step(layers, x, mode)
                sums[mode][0] += wall / args.iters
                sums[mode][1] += cpu / args.iters
        slowest = _slowest_rank([v for mode in modes for v in sums[mode]])
        for i, mode in enumerate(modes):
            times["wall"][mode].append(slowest[2 * i])
            times["cpu"][mode].append(slowest[2 * i + 1])
    memory = {mode: _memory(layers, x, mode) for mode in modes}
    input_bytes = x.numel() * x.element_size()
    return {
        "times": times,
        "memory": memory,
        "input_bytes": input_bytes,
        "threads": torch.get_num_threads(),
    }


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _ratios(times: dict[str, list[float]], mode: str, base: str) -> list[float]:
    """Per-repetition step-time ratios of ``mode`` to ``base`` (steps timed side by side)."""
    return [t / b for t, b in zip(times[mode], times[base])]


def _clock_columns(times: dict[str, list[float]], mode: str) -> list[str]:
    ratios = [_spread(_ratios(times, mode, base), ".3f") for base in BASELINES]
    return [_spread([t * 1e3 for t in times[mode]], ".1f"), *ratios]


def report_tables(result: dict, tp: int, clocks: list[str]) -> tuple[str, str]:
    """The timing/memory table and the goals table (markdown), for the given clocks."""
    from benchmark_activation_memory import markdown_table

    times, memory = result["times"], result["memory"]
    header = ["mode"]
    for clock in clocks:
        header += [f"{clock} ms/step", f"{clock} x none", f"{clock} x torch non-reentrant"]
    header += ["kept MiB", "held MiB", "peak MiB"]
    rows = []
    for mode, mem in memory.items():
        row = [mode]
        for clock in clocks:
            row += _clock_columns(times[clock], mode)
        row += [
            "n/a" if mem[k] is None else f"{mem[k] / 2**20:.2f}" for k in ("kept", "held", "peak")
        ]
        rows.append(row)
    goals = []
    for clock in clocks:
        for mode in ("ours reentrant", "ours non-reentrant"):
            goals.append(
                [
                    f"{clock}: full recompute step <= 1.35x none ({mode})",
                    _spread(_ratios(times[clock], mode, "none"), ".3f"),
                ]
            )
        for mode in ("ours reentrant", "ours non-reentrant"):
            goals.append(
                [
                    f"{clock}: overhead <= torch non-reentrant's ({mode} / torch non-reentrant)",
                    _spread(_ratios(times[clock], mode, "torch non-reentrant"), ".3f"),
                ]
            )
    split, full = memory["ours distributed"]["split_input"], result["input_bytes"]
    kept = f"{split} of {full} bytes = 1/{full / split:g} (tp = {tp})" if split else "n/a"
    goals.append(["distributed checkpoint keeps exactly 1/tp of its input", kept])
    goal_header = ["goal", "median [min-max] over repetitions"]
    return markdown_table(header, rows), markdown_table(goal_header, goals)


def rng_fork_table(device_name: str, iters: int, reps: int) -> str:
    """scripts/benchmarks/benchmark_rng_fork.py's measurement, as a markdown table."""
    from benchmark_activation_memory import markdown_table
    from benchmark_rng_fork import median_us

    device.set_device_type(device_name)
    model_parallel_cuda_manual_seed(1234, tp_rank=0)  # one process, no parallel_state
    gpus = [] if device_name == "cpu" else [device.current_device().index]
    candidates = {
        "tracker.fork()": get_cuda_rng_tracker().fork,
        f"torch.random.fork_rng(devices={gpus})": lambda: torch.random.fork_rng(devices=gpus),
    }
    results = median_us(candidates, iters, reps)
    base = results["tracker.fork()"]
    rows = [[f"`{name}`", f"{us:.2f}", f"{us / base:.2f}"] for name, us in results.items()]
    return markdown_table(["context", "us / enter+exit (median)", "ratio to tracker.fork()"], rows)


def main() -> None:
    """Parse the command line, time every checkpoint mode side by side, print and write."""
    from benchmark_activation_memory import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--iters", type=int, default=2, help="steps per mode per repetition")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (>= 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: as is)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    if args.reps < 5:
        parser.error(f"--reps ({args.reps}) must be >= 5: the spread of fewer says little")

    per_rank = run_on_ranks(measure_rank, args.tp, args.device, args)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    clocks = ["wall"] if args.device != "cpu" else ["wall", "cpu"]
    timing, goals = report_tables(per_rank[0], args.tp, clocks)
    rng = rng_fork_table(args.device, iters=20000, reps=15)
    threads = per_rank[0]["threads"]
    title = (
        f"Checkpoint modes, {args.layers} GPT layers s,b,h,a = {args.seq},{args.batch},"
        f"{args.hidden},{args.heads}, {args.dtype}, {args.device}, tp = {args.tp}, torch "
        f"{torch.__version__}, torch threads per rank: {threads}; {args.reps} repetitions x "
        f"{args.iters} steps"
    )
    text = "\n\n".join([title, timing, goals, "RNG fork microbenchmark:", rng])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"checkpoint_{args.device}_{args.dtype}_tp{args.tp}.md"
    path.write_text(text + "\n")
    print(f"written to {path}")


if __name__ == "__main__":
    # Run as the importable module, so that run_distributed pickles its functions by name.
    import benchmark_checkpoint

    benchmark_checkpoint.main()
