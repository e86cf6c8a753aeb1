"""Cost of the consistency check (megatron_core.consistency) per collective, side by side.

Run on CPU / gloo (spawns the ranks itself):

    python scripts/benchmarks/benchmark_consistency.py --nproc 2

or under torchrun (e.g. on GPUs with NCCL, one GPU per rank):

    torchrun --nproc_per_node=2 scripts/benchmarks/benchmark_consistency.py --device cuda

For each message size, rank 0 prints the median over ``--reps`` interleaved repetitions of the
time of one ``reduce_from_tensor_model_parallel_region`` (an all-reduce over the TP group) in
three set-ups, and the ratios to the first:

* off: every check off (``set_mode("off")``) -- the hook costs one mode test;
* after window: the default mode once its window has closed (NOTE [ Check window ], rule 5) --
  the hook appends the all-reduce's record to the group's digest;
* check: check mode on -- one extra all-gather of 16 int64 per rank before the all-reduce;
* torch DETAIL: check mode off, on a group created under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
  (torch's ProcessGroupWrapper compares a fingerprint of every collective through its own gloo
  helper group).

Then, without communication: the time of the disabled hook (``check_collective`` in a process
where check mode is off), of the hook after the window (a record), of one ``agreed_errors``
exchange (the always-on primitive used by the cross-entropy target check and the all-to-all
split check), and of one digest of 32 records (what an iteration compares per group).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from megatron_core import consistency, device, parallel_state
from megatron_core.consistency import digest
from megatron_core.tensor_parallel import _collectives

SIZES = (8, 4096, 1 << 20)  # fp32 elements per rank: 32 B, 16 KiB, 4 MiB


def _time_us(fn, iters: int) -> float:
    mode = getattr(fn, "mode", "off")  # the mode the candidate runs in (windows kept)
    consistency.set_mode(mode, restart_windows=False)
    device.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    device.synchronize()
    seconds = time.perf_counter() - start
    consistency.set_mode("off", restart_windows=False)
    digest.discard()  # the records no digest compared
    return seconds / iters * 1e6


def _median_us(candidates: dict, iters: int, reps: int) -> dict[str, float]:
    """Interleaved repetitions: machine load affects every candidate alike; max over ranks."""
    for fn in candidates.values():
        _time_us(fn, max(1, iters // 4))  # warm-up
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            local = torch.tensor([_time_us(fn, iters)], dtype=torch.float64)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
            times[name].append(float(local))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _checked(fn):
    def run():
        with consistency.check_mode(True):
            fn()

    return run


def _after_window(fn):
    """``fn`` in the default mode with the group's window closed (``set_window(0)`` once: the
    group closes at its first collective, each call appends a record), the windows kept."""

    def run():
        fn()

    run.mode = "window"
    return run


def _detail_group(ranks: list[int]) -> dist.ProcessGroup:
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group(ranks, timeout=datetime.timedelta(minutes=5))
    finally:
        dist.set_debug_level(previous)


def run(reps: int, iters: int) -> list[str] | None:
    """Run on every rank (torch.distributed initialized); rank 0 returns the table lines."""
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    detail = _detail_group(list(range(world)))
    consistency.set_window(0)  # the default mode's groups close at their first collective
    consistency.set_mode("off")
    where = device.current_device()
    lines = [
        f"{world} ranks, {dist.get_backend(group)}, device {where.type}; median of {reps} "
        f"interleaved repetitions; microseconds per call (slowest rank)",
        "",
        "| fp32 elements per rank | off (us) | after window (us) | check (us) | torch DETAIL "
        "(us) | after window / off | check / off | DETAIL / off |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for numel in SIZES:
        x = torch.ones(numel, device=where)
        n = max(5, iters * 64 // max(64, numel // 64))
        result = _median_us(
            {
                "off": lambda x=x: _collectives.all_reduce(x, group),
                "after": _after_window(lambda x=x: _collectives.all_reduce(x, group)),
                "check": _checked(lambda x=x: _collectives.all_reduce(x, group)),
                "detail": lambda x=x: _collectives.all_reduce(x, detail),
            },
            n,
            reps,
        )
        off = result["off"]
        lines.append(
            f"| {numel} | {off:.1f} | {result['after']:.1f} | {result['check']:.1f} | "
            f"{result['detail']:.1f} | {result['after'] / off:.2f} | {result['check'] / off:.2f} "
            f"| {result['detail'] / off:.2f} |"
        )

    def hook_off():
        consistency.check_collective("all_reduce", group, x)

    def agreed():
        with consistency.agreed_errors("benchmark", group):
            pass

    def one_digest():
        for _ in range(32):
            consistency.check_collective("all_reduce", group, x)
        consistency.compare_now()

    x = torch.ones(8, device=where)
    candidates = {"hook_off": hook_off, "hook_after": _after_window(hook_off), "agreed": agreed}
    local = _median_us({**candidates, "digest": _after_window(one_digest)}, iters * 10, reps)
    lines += [
        "",
        f"hook (check_collective) with check mode off: {local['hook_off']:.2f} us per call; "
        f"after the window (a record): {local['hook_after']:.2f} us; one agreed_errors "
        f"exchange: {local['agreed']:.1f} us; 32 records and their digest: "
        f"{local['digest']:.1f} us",
    ]
    consistency.set_window(None)
    consistency.set_mode(None)
    return lines if dist.get_rank() == 0 else None


def main() -> None:
    """Parse the command line, run the ranks (or join torchrun's), print the table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (without torchrun)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=9, help="repetitions (the median is reported)")
    parser.add_argument("--iters", type=int, default=50, help="calls per repetition (small size)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        device.set_device_type(args.device)
        device.set_current_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(device.default_backend())
        lines = run(args.reps, args.iters)
        dist.destroy_process_group()
    else:
        if args.device != "cpu":
            parser.error("--device cuda needs torchrun (one process per GPU)")
        from megatron_core.testing import run_distributed

        lines = run_distributed(run, args.nproc, args.reps, args.iters, timeout=1800)[0]
    if lines:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
