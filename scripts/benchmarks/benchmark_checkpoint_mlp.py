"""Our non-reentrant checkpoint against torch's, on a residual MLP model, one process.

Run::

    python scripts/benchmarks/benchmark_checkpoint_mlp.py       # 1 and 2 threads, 13 rounds
    python scripts/benchmarks/benchmark_checkpoint_mlp.py --threads 1 --rounds 5 --tokens 512

Model: ``--blocks`` residual blocks ``x = x + Linear(gelu(Linear(x)))`` (hidden -> hidden twice),
``--tokens`` x ``--hidden`` fp32 input, each block one checkpoint. Modes:

    none                       no checkpoint
    torch non-reentrant        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    ours non-reentrant         tensor_parallel.checkpoint(block, False, x, use_reentrant=False)
    ours, no early stop        the same with early_stop=False (what early stop saves)

The RNG tracker is seeded (model_parallel_cuda_manual_seed), as in a megatron model: our
checkpoint snapshots its streams, torch's does not. A round times one forward + backward step of
every mode, in an order rotated from round to round, so a slow spell of a shared machine hits all
modes alike; reported are the median step time per mode and the median (min-max) over rounds of
the per-round ratio to "torch non-reentrant", i.e. of steps timed next to each other, for the
wall clock and for this process's CPU time (less disturbed by other processes on a shared box).

Memory, from one extra step per mode: "peak alive" is the largest number of bytes held at once
during backward by storages that ops made during the step (a TorchDispatchMode keeps a weak
reference to each; the parameters are made before and not counted, their gradients are), and
"saved" what autograd keeps for backward after the forward (count_saved_activations, parameters
excluded).
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from collections.abc import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_core.tensor_parallel import (
    checkpoint,
    count_saved_activations,
    model_parallel_cuda_manual_seed,
)

MODES: dict[str, Callable | None] = {
    "none": None,
    "torch non-reentrant": lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False),
    "ours non-reentrant": lambda f, x: checkpoint(f, False, x, use_reentrant=False),
    "ours, no early stop": lambda f, x: checkpoint(
        f, False, x, use_reentrant=False, early_stop=False
    ),
}
BASE = "torch non-reentrant"


class _PeakAlive(TorchDispatchMode):
    """Peak bytes of op-made storages alive at once, sampled at every op of the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[weakref.ref, int]] = {}
        self.peak, self.in_backward = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs[id(storage)] = (weakref.ref(storage), storage.nbytes())
        if self.in_backward:
            self.refs = {k: v for k, v in self.refs.items() if v[0]() is not None}
            self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def _build(args) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    h = args.hidden
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.GELU(), torch.nn.Linear(h, h))
        for _ in range(args.blocks)
    ]
    return torch.nn.ModuleList(blocks)


def _step(blocks, x0: torch.Tensor, mode: str, peak: _PeakAlive | None = None) -> None:
    wrap = MODES[mode]
    x = x0.clone().requires_grad_()
    h = x
    for block in blocks:
        h = h + (wrap(block, h) if wrap is not None else block(h))
    if peak is not None:
        peak.in_backward = True
    h.sum().backward()
    for p in blocks.parameters():
        p.grad = None


def _memory(blocks, x0: torch.Tensor, mode: str) -> tuple[int, int]:
    with _PeakAlive() as peak:
        _step(blocks, x0, mode, peak)
    with count_saved_activations(ignore=blocks.parameters()) as report:
        x = x0.clone().requires_grad_()
        h = x
        wrap = MODES[mode]
        for block in blocks:
            h = h + (wrap(block, h) if wrap is not None else block(h))
    saved = report.total_bytes
    h.sum().backward()
    for p in blocks.parameters():
        p.grad = None
    return peak.peak, saved


def run(args, threads: int) -> str:
    """Time every mode at ``threads`` torch threads; the markdown table."""
    torch.set_num_threads(threads)
    model_parallel_cuda_manual_seed(1234, tp_rank=0)  # one process, no parallel_state
    blocks = _build(args)
    x0 = torch.randn(args.tokens, args.hidden)
    names = list(MODES)
    for mode in names:  # warm-up: first calls allocate and initialize lazily
        _step(blocks, x0, mode)
    wall: dict[str, list[float]] = {m: [] for m in names}
    cpu: dict[str, list[float]] = {m: [] for m in names}
    for r in range(args.rounds):
        for mode in names[r % len(names) :] + names[: r % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            _step(blocks, x0, mode)
            wall[mode].append(time.perf_counter() - start)
            cpu[mode].append(time.process_time() - start_cpu)
    rows = [
        "| mode | median step, wall / cpu (s) | / torch non-reentrant, wall: median (min-max) "
        "of per-round ratios | same, cpu time | peak alive in backward (MB) | saved after "
        "forward (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for mode in names:
        peak, saved = _memory(blocks, x0, mode)
        cells = []
        for times in (wall, cpu):
            ratios = [a / b for a, b in zip(times[mode], times[BASE])]
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        rows.append(
            f"| {mode} | {statistics.median(wall[mode]):.3f} / "
            f"{statistics.median(cpu[mode]):.3f} | {cells[0]} | {cells[1]} | "
            f"{peak / 2**20:.1f} | {saved / 2**20:.1f} |"
        )
    title = (
        f"{args.blocks} residual MLP blocks, hidden {args.hidden}, {args.tokens} tokens, fp32, "
        f"cpu, torch {torch.__version__}, {threads} thread(s), {args.rounds} rounds"
    )
    return title + "\n\n" + "\n".join(rows)


def main() -> None:
    """Parse the command line, run each thread count, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    args = parser.parse_args()
    for threads in (int(t) for t in args.threads.split(",")):
        print(run(args, threads), flush=True)
        print()


if __name__ == "__main__":
    main()
