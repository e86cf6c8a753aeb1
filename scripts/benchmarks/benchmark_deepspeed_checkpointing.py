"""Benchmark megatron_core.deepspeed_checkpointing against DeepSpeed's own, in one run.

The same 8-layer tensor-parallel MLP stack (f -> column-parallel linear -> gelu -> row-parallel
linear -> g -> + residual -> dropout on the default generator), TP=2 on gloo ranks (CPU),
each layer one checkpoint, with partition_activations and then partition_activations +
checkpoint_in_cpu. Rounds are interleaved (ours, DeepSpeed's, ours, ...) and the medians are
reported per rank:

* step: wall time of forward + backward of the whole stack (ms);
* kept: RSS growth from before the forward to after it, the loss still alive (MiB): what the
  checkpoints keep until backward, plus the output;
* peak: the highest RSS during the step above the RSS before it (MiB), sampled every 0.2 ms by a
  thread reading /proc/self/statm. RSS, not tracemalloc: torch's CPU allocator bypasses Python's
  allocator, so tracemalloc sees no tensor. MALLOC_MMAP_THRESHOLD_ is fixed at 64 KiB so freed
  tensors go back to the OS and RSS follows the live tensors.

Both runs must agree: the script checks that outputs and gradients are bitwise equal.

Usage (DeepSpeed is a benchmark-only dependency, in its own environment)::

    /tmp/dsvenv/bin/python scripts/benchmarks/benchmark_deepspeed_checkpointing.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

LAYERS = 8


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """Sample RSS in a thread; ``peak`` is the highest value seen while running."""

    def __enter__(self):
        self.peak, self.running = _rss(), True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _rss())


class _Layer(nn.Module):
    def __init__(self, hidden, ffn, tp, rank, p):
        super().__init__()
        shard = ffn // tp
        rows = slice(rank * shard, (rank + 1) * shard)
        w1, w2 = torch.randn(ffn, hidden) / hidden**0.5, torch.randn(hidden, ffn) / ffn**0.5
        self.w1 = nn.Parameter(w1[rows].clone())
        self.w2 = nn.Parameter(w2[:, rows].clone())
        self.p = p

    def forward(self, x):
        from megatron_core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        h = F.gelu(F.linear(copy_to_tensor_model_parallel_region(x), self.w1))
        h = reduce_from_tensor_model_parallel_region(F.linear(h, self.w2))
        return F.dropout(x + h, self.p)


def _step(ckpt, layers, x0, seed):
    torch.manual_seed(seed)
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    before = _rss()
    start = time.perf_counter()
    with _PeakRSS() as peak:
        h = x
        for layer in layers:
            h = ckpt(layer, h)
        loss = h.float().pow(2).mean()
        kept = _rss() - before
        loss.backward()
    elapsed = time.perf_counter() - start
    grads = [x.grad] + [p.grad for p in layers.parameters()]
    return elapsed * 1e3, kept / 2**20, (peak.peak - before) / 2**20, h.detach(), grads


def _rank(rank, world, init_file, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as theirs

    from megatron_core import deepspeed_checkpointing as ours
    from megatron_core import parallel_state

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group set up above
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(1234)
    layers = nn.ModuleList(
        [_Layer(args.hidden, args.ffn, world, rank, args.dropout) for _ in range(LAYERS)]
    )
    x0 = torch.randn(args.tokens, args.hidden)
    results = {}
    for cpu in (False, True):
        mode = "partition_activations" + (" + checkpoint_in_cpu" if cpu else "")
        for module in (ours, theirs):
            module.configure(parallel_state, partition_activations=True, checkpoint_in_cpu=cpu)
        times = {"ours": [], "deepspeed": []}
        for r in range(args.rounds + 1):  # round 0 warms up and is dropped
            outs = {}
            for name, module in (("ours", ours), ("deepspeed", theirs)):
                dist.barrier()
                ms, kept, peak, out, grads = _step(module.checkpoint, layers, x0, seed=r)
                outs[name] = (out, grads)
                if r:
                    times[name].append((ms, kept, peak))
            same = torch.equal(outs["ours"][0], outs["deepspeed"][0]) and all(
                torch.equal(a, b) for a, b in zip(outs["ours"][1], outs["deepspeed"][1])
            )
            if not same:
                raise SystemExit(f"rank {rank}: {mode}: ours and DeepSpeed's results differ")
        results[mode] = {
            name: tuple(statistics.median(v[i] for v in values) for i in range(3))
            for name, values in times.items()
        }
    queue.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank, args=(r, world, f"{tmp}/init", args, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got = {}
        while len(got) < world:
            try:
                rank, result = queue.get(timeout=5)
                got[rank] = result
            except Exception:  # queue.Empty: stop when a rank died
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("a rank failed (its traceback is above)") from None
        for p in procs:
            p.join()
    import deepspeed

    print(
        f"TP={world}, {LAYERS} layers, tokens={args.tokens} hidden={args.hidden} ffn={args.ffn} "
        f"dropout={args.dropout}, {args.rounds} interleaved rounds (medians), "
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, CPU/gloo, "
        f"{args.threads} thread(s) per rank; memory is RSS (MiB)"
    )
    print(f"{'mode':44} {'rank':>4} {'impl':>9} {'step ms':>9} {'kept MiB':>9} {'peak MiB':>9}")
    for rank in sorted(got):
        for mode, impls in got[rank].items():
            for name, (ms, kept, peak) in impls.items():
                print(f"{mode:44} {rank:>4} {name:>9} {ms:9.1f} {kept:9.2f} {peak:9.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
