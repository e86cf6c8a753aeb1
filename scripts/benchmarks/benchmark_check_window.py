"""Cost of the default consistency mode (the check window) on the main job, against checks off.

Run on CPU / gloo (spawns the ranks itself):

    python scripts/benchmarks/benchmark_check_window.py --nproc 2 --tp 2
    python scripts/benchmarks/benchmark_check_window.py --nproc 4 --tp 2 --pp 2

or under torchrun (e.g. on GPUs with NCCL, one GPU per rank):

    torchrun --nproc_per_node=2 scripts/benchmarks/benchmark_check_window.py --tp 2 --device cuda

Each rank builds the main job (scripts/train_gpt.py's model, optimizer and ``train_step``, its
default flags plus ``--tp`` / ``--pp`` and ``--extra``) and then:

1. The window: from restarted windows, one iteration in the default mode
   (``CheckMode.WINDOW``), then one with every check off (the windows kept:
   ``set_mode(..., restart_windows=False)``), and so on until every group's window has closed
   on every rank (NOTE [ Check window ] in megatron_core/consistency/switch.py). The summed
   difference is the window's one-off cost.
2. Steady state: ``--rounds`` interleaved rounds of ``--iters`` iterations, default mode (its
   windows closed, kept: ``set_mode(..., restart_windows=False)``) and checks off, the order
   alternating between rounds. Reported: the median ms/iteration of each (slowest rank), their
   ratio, and the median of the per-round ratios; the same for the CPU time the process used
   (``time.process_time``: less disturbed by other jobs on a shared machine than wall-clock
   time, and the checks' cost is CPU work plus a small exchange); the consistency exchanges
   counted in each mode's rounds (once its windows are closed the default mode adds a head and
   a digest per group and iteration, NOTE [ Check window ], rules 5-6; both modes keep the
   always-on cross-entropy target agreement).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.distributed as dist

from megatron_core import consistency, device, parallel_state
from megatron_core.consistency import CheckMode, checks, digest
from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_core.training import (
    ByteCorpus,
    build_model_and_optimizer,
    model_config,
    parse_args,
    train_step,
    validate_args,
)
from megatron_core.training.pipeline_step import reseed_stage, virtual_pipeline_size

_EXCHANGES = [0]
_HOOKS = [0]


def _count_exchanges() -> None:
    """Count every consistency exchange (the all-gathers of checks._exchange: the window's
    checks, the heads and the always-on agreements; of digest._exchange: the per-iteration
    digests) and every decision of the switch (checks._decide: one per collective hook) on
    this rank."""
    exchange, digest_exchange, decide = checks._exchange, digest._exchange, checks._decide

    def counted(*args, **kwargs):
        _EXCHANGES[0] += 1
        return exchange(*args, **kwargs)

    def counted_digest(*args, **kwargs):
        _EXCHANGES[0] += 1
        return digest_exchange(*args, **kwargs)

    def counted_hook(group):
        _HOOKS[0] += 1
        return decide(group)

    checks._exchange, digest._exchange, checks._decide = counted, counted_digest, counted_hook


def _hook_costs_us(group) -> dict[str, float]:
    """Per call, microseconds: the collective hook and the embedding-id check, window closed
    (``set_window(0)``: the code path after the window, each call a record of the digest) and
    checks off."""
    ids = torch.zeros(8, 128, dtype=torch.long, device=device.current_device())
    costs = {}
    for name, mode in (("default", CheckMode.WINDOW), ("off", CheckMode.OFF)):
        consistency.set_mode(mode)
        consistency.set_window(0)
        start = time.perf_counter()
        for _ in range(20000):
            checks.check_collective("all_reduce", group, ids)
        costs[f"{name} hook"] = (time.perf_counter() - start) / 20000 * 1e6
        start = time.perf_counter()
        for _ in range(2000):
            checks.check_ids("embedding", group, ids, 256)
        costs[f"{name} ids"] = (time.perf_counter() - start) / 2000 * 1e6
        digest.discard()  # the records no digest will compare
    consistency.set_window(None)
    consistency.set_mode(None)
    return costs


def _slowest(value: float) -> float:
    """The maximum of ``value`` over the ranks (a step waits for the slowest rank)."""
    local = torch.tensor([value], dtype=torch.float64, device=device.current_device())
    dist.all_reduce(local, op=dist.ReduceOp.MAX)  # raw: the benchmark's own, never checked
    return float(local)


def _build(argv: list[str]):
    args = parse_args(argv)
    validate_args(args, dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
    )
    random.seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    model, optimizer = build_model_and_optimizer(args, model_config(args))
    if args.pipeline_model_parallel_size > 1:
        reseed_stage(args.seed)
    return args, model, optimizer, ByteCorpus.load(args.data, args.seq_length)


class _Job:
    """The main job's iterations, numbered on across calls."""

    def __init__(self, argv: list[str]):
        self.args, self.model, self.optimizer, self.corpus = _build(argv)
        self.step = 0

    def run(self, iterations: int) -> float:
        """Seconds for ``iterations`` iterations (slowest rank); ``self.cpu_s`` gets the CPU
        seconds this process used meanwhile (slowest rank)."""
        device.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(iterations):
            train_step(self.model, self.optimizer, self.corpus, self.args, self.step)
            self.step += 1
        device.synchronize()
        self.cpu_s = _slowest(time.process_time() - cpu)
        return _slowest(time.perf_counter() - start)


def _window_phase(job: _Job) -> tuple[int, list[float], list[float]]:
    """Until every window has closed on every rank: one iteration in the default mode, then
    one with every check off (the windows kept), and so on. Returns the number of default-mode
    iterations and, for each mode, [wall seconds, CPU seconds] summed."""
    consistency.set_mode(CheckMode.WINDOW)  # windows restarted
    iterations, window, off = 0, [0.0, 0.0], [0.0, 0.0]
    closing = 2  # the rare groups close in the iteration after windows_done (rule 4)
    while closing:
        consistency.set_mode(CheckMode.WINDOW, restart_windows=False)
        window[0] += job.run(1)
        window[1] += job.cpu_s
        consistency.set_mode(CheckMode.OFF, restart_windows=False)
        off[0] += job.run(1)
        off[1] += job.cpu_s
        iterations += 1
        done = torch.tensor([float(consistency.windows_done())], device=device.current_device())
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        closing -= int(float(done) == 1.0)
    return iterations, window, off


def _steady_phase(job: _Job, rounds: int, iters: int) -> dict[str, list[float]]:
    """Per mode: ms/iteration of each round, and the exchanges counted in its rounds."""
    names = ("default", "off", "default cpu", "off cpu")
    times: dict[str, list[float]] = {name: [] for name in names}
    exchanges = {"default": 0, "off": 0}
    modes = {"default": CheckMode.WINDOW, "off": CheckMode.OFF}
    for index in range(rounds):
        order = ("default", "off") if index % 2 == 0 else ("off", "default")
        for name in order:
            consistency.set_mode(modes[name], restart_windows=False)
            before, hooks = _EXCHANGES[0], _HOOKS[0]
            times[name].append(job.run(iters) / iters * 1e3)
            exchanges[f"{name} hooks"] = (_HOOKS[0] - hooks) / iters
            times[f"{name} cpu"].append(job.cpu_s / iters * 1e3)
            exchanges[name] += int(_slowest(_EXCHANGES[0] - before))  # the most on any rank
    consistency.set_mode(None)
    return times, exchanges


def run(argv: list[str], rounds: int, iters: int, warmup: int) -> list[str] | None:
    """Run on every rank (torch.distributed initialized); rank 0 returns the report lines."""
    _count_exchanges()
    job = _Job(argv)
    consistency.set_mode(CheckMode.OFF)
    job.run(warmup)  # allocator, threads, caches
    window_iterations, window, off_window = _window_phase(job)
    times, exchanges = _steady_phase(job, rounds, iters)
    median = {name: statistics.median(values) for name, values in times.items()}
    default, off = median["default"], median["off"]
    ratios = [d / o for d, o in zip(times["default"], times["off"])]
    cpu_ratios = [d / o for d, o in zip(times["default cpu"], times["off cpu"])]
    args = job.args
    hook = _hook_costs_us(parallel_state.get_tensor_model_parallel_group())
    per_iteration_us = exchanges["default hooks"] * (hook["default hook"] - hook["off hook"])
    per_iteration_us += hook["default ids"] - hook["off ids"]  # one embedding forward
    parallel_state.destroy_model_parallel()
    if dist.get_rank() != 0:
        return None
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    n = window_iterations
    return [
        f"{dist.get_world_size()} ranks ({dist.get_backend()}, {device.device_type()}): tp={tp} "
        f"pp={pp}, main job defaults + {' '.join(argv)}; window "
        f"{consistency.window_size()} checks per group",
        f"window: {n} iterations until every group's window closed, each followed by one with "
        f"checks off: {window[0] * 1e3 / n:.1f} vs {off_window[0] * 1e3 / n:.1f} ms/iteration "
        f"(CPU {window[1] * 1e3 / n:.1f} vs {off_window[1] * 1e3 / n:.1f}); one-off cost "
        f"{(window[0] - off_window[0]) * 1e3:.0f} ms wall, {(window[1] - off_window[1]) * 1e3:.0f} "
        "ms CPU",
        f"steady state, {rounds} interleaved rounds of {iters} iterations (median ms/iteration, "
        f"slowest rank): default {default:.1f}, off {off:.1f}, default / off "
        f"{default / off:.4f}; median per-round ratio {statistics.median(ratios):.4f} "
        f"(min {min(ratios):.4f}, max {max(ratios):.4f})",
        f"steady state, CPU time of the process (median ms/iteration, slowest rank): default "
        f"{median['default cpu']:.1f}, off {median['off cpu']:.1f}, default / off "
        f"{median['default cpu'] / median['off cpu']:.4f}; median per-round ratio "
        f"{statistics.median(cpu_ratios):.4f}",
        f"consistency exchanges in the steady rounds (the most on one rank, per round, summed): "
        f"default {exchanges['default']} (with the heads and digests), "
        f"off {exchanges['off']} (the always-on cross-entropy target agreement)",
        f"switch after the window, per call: collective hook {hook['default hook']:.2f} us "
        f"(off {hook['off hook']:.2f}), embedding-id check {hook['default ids']:.1f} us (off "
        f"{hook['off ids']:.1f}); {exchanges['default hooks']:.0f} hooks per iteration on rank 0: "
        f"{per_iteration_us:.0f} us per iteration = {per_iteration_us / 10 / off:.4f}% of off",
        "per-round ms/iteration: default "
        + ", ".join(f"{t:.1f}" for t in times["default"])
        + "; off "
        + ", ".join(f"{t:.1f}" for t in times["off"]),
    ]


def main() -> None:
    """Parse the command line, run the ranks (or join torchrun's), print the report on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (without torchrun)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-model-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved steady-state rounds")
    parser.add_argument("--iters", type=int, default=2, help="iterations per round and mode")
    parser.add_argument("--warmup", type=int, default=3, help="iterations before the window")
    parser.add_argument("--extra", default="", help="more main-job flags, e.g. '--num-layers 8'")
    args = parser.parse_args()
    argv = [
        "--tensor-model-parallel-size",
        str(args.tp),
        "--pipeline-model-parallel-size",
        str(args.pp),
        "--train-iters",
        "1000000",  # a constant learning rate over the measured iterations
        *args.extra.split(),
    ]
    call = (argv, args.rounds, args.iters, args.warmup)
    if "RANK" in os.environ:  # under torchrun
        device.set_device_type(args.device)
        device.set_current_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(device.default_backend())
        lines = run(*call)
        dist.destroy_process_group()
    else:
        if args.device != "cpu":
            parser.error("--device cuda needs torchrun (one process per GPU)")
        from megatron_core.testing import run_distributed

        lines = run_distributed(run, args.nproc, *call, timeout=3600)[0]
    if lines:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
