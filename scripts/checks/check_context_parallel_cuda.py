"""Context-parallel attention on CUDA, bf16: p2p, all_gather and a2a at CP=2 against CP=1.

Two processes: on two or more GPUs one GPU each over NCCL; on one GPU both share it over gloo
(the ring's blocks then travel through host memory). Each rank takes its part of the same causal
sequence (q, k, v [s, b, h, d], bf16 on the GPU), runs forward + backward, and the gathered
output and gradients are compared with fp64 attention on the CPU; CP=2's error must be at most
twice CP=1's (the same function on one rank, bf16 on the GPU). Prints one result line per
variant and exits non-zero on a failure.

    python scripts/checks/check_context_parallel_cuda.py
"""

from __future__ import annotations

import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEQ, B, H, D = 1024, 2, 8, 64


def _reference(q, k, v):
    q, k, v = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).permute(2, 0, 1, 3)


def _error(ours, ref):
    return ((ours.double().cpu() - ref).norm() / ref.norm()).item()


def _run(group, comm, device, q, k, v, dout):
    from megatron_core.context_parallel import (
        context_parallel_attention,
        gather_from_context_parallel,
        split_for_context_parallel,
    )

    parts = [split_for_context_parallel(x, 0, group).to(device, torch.bfloat16).requires_grad_()
             for x in (q, k, v)]  # fmt: skip
    out = context_parallel_attention(*parts, cp_group=group, cp_comm_type=comm)
    out.backward(split_for_context_parallel(dout, 0, group).to(device, torch.bfloat16))
    return [gather_from_context_parallel(t.detach(), 0, group)
            for t in (out, *(p.grad for p in parts))]  # fmt: skip


def _rank(rank: int, port: int, shared: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0 if shared else rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo" if shared else "nccl", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(SEQ, B, H, D, generator=gen) for _ in range(4))
    full = [x.clone().double().requires_grad_() for x in (q, k, v)]
    ref = _reference(*full)
    ref.backward(dout.double())
    refs = [ref.detach(), *(x.grad for x in full)]
    pair = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(2)]
    lines = []
    yardstick = max(
        _error(o, r) for o, r in zip(_run(singles[rank], "p2p", device, q, k, v, dout), refs)
    )
    lines.append(
        f"cp=1 bf16 on {torch.cuda.get_device_name(device)}: max relative error {yardstick:.2e}"
    )
    failed = False
    for comm in ("p2p", "all_gather", "a2a"):
        try:
            errors = [_error(o, r) for o, r in zip(_run(pair, comm, device, q, k, v, dout), refs)]
            ok = max(errors) <= 2 * yardstick
            failed |= not ok
            lines.append(
                f"cp=2 {comm} ({'gloo, one shared GPU' if shared else 'nccl'}): max "
                f"relative error {max(errors):.2e} {'ok' if ok else 'FAIL (> 2 x cp=1)'}"
            )
        except Exception as error:  # noqa: BLE001 - reported, the other variants still run
            failed = True
            lines.append(f"cp=2 {comm}: FAIL {type(error).__name__}: {error}")
    if rank == 0:
        queue.put((lines, failed))
    dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available():
        print("check_context_parallel_cuda: no CUDA device")
        return 1
    shared = torch.cuda.device_count() < 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, shared, queue)) for r in range(2)]
    for p in procs:
        p.start()
    lines, failed = queue.get(timeout=600)
    for p in procs:
        p.join()
    print("\n".join(lines))
    return 1 if failed or any(p.exitcode for p in procs) else 0


if __name__ == "__main__":
    sys.exit(main())
