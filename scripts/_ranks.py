"""Start N local gloo ranks of a benchmark or check script and collect rank 0's result (shared by
scripts/benchmarks and scripts/checks, imported as ``scripts._ranks`` with the repository root on
``sys.path``; the test suite uses megatron_core.testing instead)."""

from __future__ import annotations

import queue as queue_module
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args):
    """Run ``target(rank, *args, port, queue)`` in ``world`` spawned processes; return what
    rank 0 puts on the queue. A rank that dies is reported instead of waited for."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, *args, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(f"{world} ranks: a rank failed (its traceback is above)") from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"{world} ranks: a rank exited with {p.exitcode}")
    return result


def cpu_sum_wall_max(cpu: float, wall: float) -> tuple[float, float]:
    """A round's CPU seconds summed over the default group's ranks and its wall seconds, the
    slowest rank's (two all_reduces: call it on every rank)."""
    cpu_sum = torch.tensor([cpu], dtype=torch.float64)
    wall_max = torch.tensor([wall], dtype=torch.float64)
    dist.all_reduce(cpu_sum)
    dist.all_reduce(wall_max, op=dist.ReduceOp.MAX)
    return cpu_sum.item(), wall_max.item()
