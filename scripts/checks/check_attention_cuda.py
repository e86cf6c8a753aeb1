"""The attention core on a GPU (NOTE [ Fused attention ]): which SDPA kernel each case runs, the
fused results against the unfused computation, and our GPT's tokens/s fused vs unfused.

One process (world size 1)::

    python scripts/checks/check_attention_cuda.py         # H100 / H200: s 4096, hidden 2048
    python scripts/checks/check_attention_cuda.py --device cpu --seq 64 --hidden 64 --layers 2 \
        --iters 1

1. Kernels and numerics, per case (causal, padding mask, GQA, dropout; bf16 and fp32): the
   kernel the core chose (``attention.kernels_used``), and the error of the fused output and
   dQ / dK / dV against an fp64 computation next to the unfused path's own error (fp32: fused
   within 1e-5 of unfused; bf16: at most 1.5 times the unfused error). The context-parallel
   blocks (``AttentionBlocks``, CUDA's memory-efficient ops) against the unfused blocks on the
   whole sequence the same way. Dropout: a checkpointed call (``tensor_parallel.checkpoint``)
   equals the plain one bitwise, output and gradients.
2. Our GPT (``--layers`` layers, ``--hidden``, 16 heads, sequence ``--seq``, micro batch 1,
   bf16 parameters, no dropout): ``--iters`` timed forward + backward steps after one warm-up
   per backend ("fused", "unfused"), alternately; tokens/s and ``max_memory_allocated``.

Exits non-zero when a numerics check fails. Prints "attention:" lines (gpu_check.sh collects
them) and one table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_core import device, parallel_state  # noqa: E402
from megatron_core.attention import (  # noqa: E402
    AttentionBlocks,
    dot_product_attention,
    kernels_used,
)
from megatron_core.tensor_parallel import (  # noqa: E402
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_core.transformer import GPTModel, TransformerConfig  # noqa: E402

CASES = {  # name: (kv heads divisor, padding mask, dropout)
    "causal": (1, False, 0.0),
    "padding + causal": (1, True, 0.0),
    "gqa causal": (4, False, 0.0),
}


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(s, heads, kv_div, d, dtype, mask):
    gen = torch.Generator().manual_seed(s + kv_div)
    dev = device.current_device()
    shapes = [(s, 2, heads, d), (s, 2, heads // kv_div, d), (s, 2, heads // kv_div, d)]
    tensors = [torch.randn(shape, generator=gen).to(dev, dtype) for shape in shapes]
    grad = torch.randn(s, 2, heads, d, generator=gen).to(dev, dtype)
    padding = None
    if mask:
        padding = torch.zeros(2, 1, s, s, dtype=torch.bool)
        padding[1, :, :, s - s // 4 :] = True
        padding = padding.to(dev)
    return tensors, grad, padding


def _run(tensors, grad, **options):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = dot_product_attention(*leaves, **options)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def check_core(s: int, heads: int, d: int) -> list[str]:
    """Part 1: one line per case and dtype; "FAIL" in a line that failed."""
    lines = []
    for name, (kv_div, mask, _) in CASES.items():
        for dtype in (torch.bfloat16, torch.float32):
            tensors, grad, padding = _inputs(s, heads, kv_div, d, dtype, mask)
            options = {"causal": True, "attention_mask": padding}
            exact = _run([t.double() for t in tensors], grad.double(), backend="unfused", **options)
            kernels_used(reset=True)
            fused = _run(tensors, grad, **options)
            kernel = ",".join(k for (_, k) in kernels_used())
            unfused = _run(tensors, grad, backend="unfused", **options)
            worst = max(
                _rel(f, e) / max(_rel(u, e), 1e-12) for f, u, e in zip(fused, unfused, exact)
            )
            apart = max(_rel(f, u) for f, u in zip(fused, unfused))
            ok = apart <= 1e-5 if dtype == torch.float32 else worst <= 1.5
            lines.append(
                f"attention: {name:18s} {str(dtype)[6:]:8s} kernel {kernel:10s} fused vs "
                f"unfused {apart:.1e}, fused/unfused error vs fp64 {worst:.2f} "
                + ("ok" if ok else "FAIL")
            )
    return lines


def check_blocks(s: int, heads: int, d: int) -> list[str]:
    """Part 1, the context-parallel blocks: the fused block ops on the whole sequence."""
    lines = []
    for dtype in (torch.bfloat16, torch.float32):
        (q, k, v), grad, _ = _inputs(s, heads, 2, d, dtype, False)
        q, k, v, grad = (x.permute(1, 2, 0, 3) for x in (q, k, v, grad))
        results = {}
        for backend in ("fused", "unfused"):
            blocks = AttentionBlocks(q, 0.0, 0, backend, "check_attention_cuda")
            scale = 1.0 / math.sqrt(d)
            out, lse = blocks.forward(q, k, v, True, scale)
            delta = (grad.to(blocks.acc) * out).sum(-1)
            grads = blocks.backward(q, k, v, True, scale, grad.to(blocks.acc), out, lse, delta)
            results[backend] = (blocks.choice.kernel, [out, lse, *grads])
        apart = max(_rel(f, u) for f, u in zip(results["fused"][1], results["unfused"][1]))
        bound = 1e-5 if dtype == torch.float32 else 2e-2
        lines.append(
            f"attention: cp blocks {str(dtype)[6:]:8s} kernel {results['fused'][0]:10s} fused "
            f"vs unfused {apart:.1e} " + ("ok" if apart <= bound else "FAIL")
        )
    return lines


def check_dropout_recompute(s: int, heads: int, d: int) -> list[str]:
    tensors, grad, _ = _inputs(s, heads, 1, d, torch.bfloat16, False)
    results = []
    kernels_used(reset=True)
    for wrapped in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        state = get_cuda_rng_tracker().get_states()
        with get_cuda_rng_tracker().fork():

            def attend(*x):
                return dot_product_attention(*x, dropout_p=0.1)

            out = checkpoint(attend, False, *leaves) if wrapped else attend(*leaves)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in leaves)])
        get_cuda_rng_tracker().set_states(state)
    same = all(torch.equal(a, b) for a, b in zip(*results))
    kernel = ",".join(sorted({k for (_, k) in kernels_used()}))
    return [f"attention: dropout 0.1 bf16 kernel {kernel}: checkpointed == plain bitwise "
            + ("ok" if same else "FAIL")]  # fmt: skip


def time_gpt(args) -> list[str]:
    """Part 2: our GPT fused vs unfused, tokens/s and peak memory."""
    rows = ["| backend | tokens/s | ms/step | max_memory_allocated GiB |", "|---|---|---|---|"]
    models = {}
    for backend in ("fused", "unfused"):
        config = TransformerConfig(
            num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16,
            hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend,
            params_dtype=torch.bfloat16, use_cpu_initialization=args.device == "cpu",
        )  # fmt: skip
        models[backend] = GPTModel(config, 32768, args.seq).to(device.current_device())
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 32768, (1, args.seq), generator=gen)
                      .to(device.current_device()) for _ in range(2))  # fmt: skip
    times = {name: [] for name in models}
    peaks = {}
    for step in range(args.iters + 1):
        for name, model in models.items():
            device.synchronize()
            device.reset_peak_memory_stats()
            start = time.perf_counter()
            model(tokens, labels).float().mean().backward()
            device.synchronize()
            if step:
                times[name].append(time.perf_counter() - start)
                peaks[name] = device.max_memory_allocated()
            model.zero_grad(set_to_none=True)
    for name, spent in times.items():
        per_step = sorted(spent)[len(spent) // 2]
        rows.append(
            f"| {name} | {args.seq / per_step:,.0f} | {per_step * 1e3:.1f} | "
            f"{peaks[name] / 2**30:.2f} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    device.set_device_type(args.device)
    if not dist.is_initialized():
        dist.init_process_group(device.default_backend(), rank=0, world_size=1)
        device.set_current_device(0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(3)
    heads, d = 16, args.hidden // 16
    lines = check_core(args.seq, heads, d) + check_blocks(args.seq, heads, d)
    lines += check_dropout_recompute(args.seq, heads, d)
    print(f"attention: torch {torch.__version__}, {device.device_type()}, s = {args.seq}, "
          f"heads {heads}, head dim {d}")  # fmt: skip
    print("\n".join(lines))
    print(f"\nour GPT: {args.layers} layers, hidden {args.hidden}, 16 heads, seq {args.seq}, "
          "micro batch 1, bf16 parameters")  # fmt: skip
    print("\n".join(time_gpt(args)))
    return 1 if any("FAIL" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
