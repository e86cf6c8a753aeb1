"""Context-parallel attention: per-rank saved bytes and step time of each variant at CP 1/2/4,
and the p2p ring's overlap (communication hidden behind compute vs exposed).

For every CP size a fresh group of ``cp`` gloo processes (one thread each) runs
``megatron_core.context_parallel.context_parallel_attention`` forward + backward on its part of
a causal sequence (q, k, v [s/cp, b, h, d], fp32), ``--rounds`` times per case after one
warm-up; the report gives the slowest rank's median step time and the bytes one rank keeps for
backward (saved-tensor hooks: Q, K, V, the fp32 output and the log-sum-exp). ``p2p (exposed)``
is the ring with each step waiting for its block before computing
(``attention._RING_OVERLAP = False``). On the 2-core VM, CP=4 runs 4 processes on 2 cores, so
its times measure contention as much as the algorithm.

    python scripts/benchmarks/benchmark_context_parallel.py --seq 2048 4096 8192 --cp 1 2 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts._ranks import run_ranks  # noqa: E402


def _rank(rank: int, cp: int, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    from megatron_core.context_parallel import attention, context_parallel_attention

    group = dist.new_group(list(range(cp)))
    results = {}
    variants = ["p2p", "all_gather", "a2a", "p2p (exposed)"] if cp > 1 else ["local"]
    for seq in args.seq:
        for variant in variants:
            comm = variant.split()[0] if cp > 1 else "p2p"
            attention._RING_OVERLAP = variant != "p2p (exposed)"
            gen = torch.Generator().manual_seed(rank)
            shape = (seq // cp, args.batch, args.heads, args.head_dim)
            q, k, v = (torch.randn(*shape, generator=gen).requires_grad_() for _ in range(3))
            saved: list[int] = []

            def pack(t, saved=saved):
                saved.append(t.numel() * t.element_size())
                return t

            times = []
            for round_ in range(args.rounds + 1):
                saved.clear()
                dist.barrier(group)
                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = context_parallel_attention(q, k, v, cp_group=group, cp_comm_type=comm)
                out.sum().backward()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                if round_:
                    times.append(elapsed.item())
            results[(seq, variant)] = (statistics.median(times), sum(saved))
    attention._RING_OVERLAP = True
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"causal attention, b={args.batch}, heads={args.heads}, head dim {args.head_dim}, fp32, "
        f"forward + backward, median of {args.rounds} rounds (slowest rank), torch "
        f"{torch.__version__}"
    )
    print("| seq | cp | variant | step s | saved MiB per rank |")
    print("|---:|---:|---|---:|---:|")
    for cp in args.cp:
        for (seq, variant), (seconds, saved) in sorted(run_ranks(_rank, cp, cp, args).items()):
            print(f"| {seq} | {cp} | {variant} | {seconds:.3f} | {saved / 2**20:.2f} |")


if __name__ == "__main__":
    main()
