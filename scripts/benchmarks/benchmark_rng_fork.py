"""Cost of one RNG tracker fork() enter/exit vs torch.random.fork_rng() on the same device.

Run (single process, no torchrun):

    python scripts/benchmarks/benchmark_rng_fork.py                  # cpu
    python scripts/benchmarks/benchmark_rng_fork.py --device cuda    # the current GPU

Prints a markdown table: the median over ``--reps`` interleaved repetitions of the per-iteration
time of an empty ``with`` block, for

* ``tracker.fork()``: swaps "model-parallel-rng" into the device generator and back
  (NOTE [ RNG streams ], rule 4);
* ``torch.random.fork_rng()``: saves and restores the CPU generator, plus the current GPU's
  generator on cuda (``devices=[]`` on cpu).

On cpu both save and restore one 5 KB CPU generator state; on cuda fork_rng also saves the CPU
state, which tracker.fork() does not touch (rule 6), so the two do different amounts of work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_core import device
from megatron_core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed


def time_per_iteration_us(make_context, iters: int) -> float:
    """Mean time of one empty ``with make_context():`` block over ``iters``, in microseconds."""
    device.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        with make_context():
            pass
    device.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def median_us(candidates: dict, iters: int, reps: int) -> dict[str, float]:
    """Median per-iteration time of each candidate; repetitions are interleaved so that machine
    load affects every candidate alike."""
    for make_context in candidates.values():  # warm-up
        time_per_iteration_us(make_context, min(iters, 1000))
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, make_context in candidates.items():
            times[name].append(time_per_iteration_us(make_context, iters))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    """Parse the command line and print the fork microbenchmark table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--iters", type=int, default=20000, help="enter/exit pairs per repetition")
    parser.add_argument("--reps", type=int, default=15, help="repetitions (the median is reported)")
    args = parser.parse_args()

    device.set_device_type(args.device)
    model_parallel_cuda_manual_seed(1234, tp_rank=0)  # one process, no parallel_state
    tracker = get_cuda_rng_tracker()
    gpus = [] if args.device == "cpu" else [device.current_device().index]
    candidates = {
        "tracker.fork()": tracker.fork,
        f"torch.random.fork_rng(devices={gpus})": lambda: torch.random.fork_rng(devices=gpus),
    }
    results = median_us(candidates, args.iters, args.reps)
    baseline = results[next(iter(results))]
    print(
        f"device: {args.device}, torch {torch.__version__}, {args.iters} iters x {args.reps} reps"
    )
    print()
    print("| context | us / enter+exit (median) | ratio to tracker.fork() |")
    print("|---|---:|---:|")
    for name, us in results.items():
        print(f"| `{name}` | {us:.2f} | {us / baseline:.2f} |")


if __name__ == "__main__":
    main()
