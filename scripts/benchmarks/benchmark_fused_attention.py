"""The attention core on torch's fused kernels against the unfused computation (NOTE [ Fused
attention ]): saved bytes and step time of one GPT layer, and the context-parallel blocks.

Run::

    python scripts/benchmarks/benchmark_fused_attention.py   # CPU, fp32, s 1024 2048 4096
    python scripts/benchmarks/benchmark_fused_attention.py --seq 1024 --rounds 3 --cp-seq 0
    torchrun --nproc_per_node=1 scripts/benchmarks/benchmark_fused_attention.py --device cuda \
        --dtype bf16

Part 1, one ``megatron_core.transformer.TransformerLayer`` (TP 1, one rank; hidden dropout 0.1,
attention dropout 0: torch's CPU flash kernel has no dropout, so on the CPU "auto" would run
unfused with it) with ``attention_backend`` "fused" and "unfused":

- saved bytes: one forward inside ``count_saved_activations`` (parameters ignored), against
  Korthikanti et al.'s per-layer formula with the inputs' B bytes per element and the device's M
  bytes per dropout-mask element (benchmark_activation_memory.py's module docstring): the linear
  part sbh(16B + 2M) (34 sbh with B = 2, M = 1; 72 sbh in fp32 on the CPU, where a mask is the
  float noise, M = B) and, unfused, the core attention's softmax output in fp32 (4 as^2 b), its
  cast to B bytes that the second product keeps (B as^2 b, none in fp32) and the bool causal
  mask (s^2); no attention dropout here, so not the paper's 5as/h. "fused - linear" is what the
  fused layer keeps beyond the linear formula: the kernel's fp32 log-sum-exp (4 a s b), the
  LayerNorm statistics, and with b > 1 the projection's input, a copy of the kernel's output
  (B sbh; at b = 1 the two share storage).
- step time: forward + backward of the layer, both backends alternately in each round (the
  order flipped every round) after a warm-up round; the median time and the median of the
  per-round ratios fused / unfused. Read only the ratio on a shared machine.

Part 2 (``--cp-seq``, 0 to skip; CPU: two gloo ranks): ``context_parallel_attention`` at CP 2,
p2p and all_gather, forward + backward of [s/2, b, a, d] per rank, fused / unfused blocks, timed
the same way (rank 0's clock).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_core import device, parallel_state  # noqa: E402
from megatron_core.context_parallel import (  # noqa: E402
    context_parallel_attention,
    split_for_context_parallel,
)
from megatron_core.tensor_parallel import (  # noqa: E402
    count_saved_activations,
    model_parallel_cuda_manual_seed,
)
from megatron_core.testing import run_distributed  # noqa: E402
from megatron_core.transformer import TransformerConfig, TransformerLayer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ("fused", "unfused")
MIB = 2**20


def _layer(backend: str, s: int, h: int, a: int, dtype) -> TransformerLayer:
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=a, hidden_dropout=0.1,
        attention_dropout=0.0, attention_backend=backend, params_dtype=dtype,
    )  # fmt: skip
    return TransformerLayer(config).to(device.current_device())


def _input(s, b, h, dtype):
    return torch.randn(s, b, h, device=device.current_device(), dtype=dtype, requires_grad=True)


def _mask_bytes(dtype) -> int:
    x = torch.randn(64, device=device.current_device(), dtype=dtype, requires_grad=True)
    with count_saved_activations(ignore=[x]) as report:
        torch.nn.functional.dropout(x * 1.0, p=0.5, training=True)
    return report.total_bytes // 64


def saved_bytes(backend, s, b, h, a, dtype) -> int:
    layer = _layer(backend, s, h, a, dtype)
    hidden = _input(s, b, h, dtype)
    with count_saved_activations(ignore=layer.parameters()) as report:
        out = layer(hidden)
        kept = report.resident_bytes()
    out.float().sum().backward()
    return kept


def _timed(step) -> float:
    device.synchronize()
    start = time.perf_counter()
    step()
    device.synchronize()
    return time.perf_counter() - start


def step_times(s, b, h, a, dtype, rounds: int) -> tuple[float, float, float]:
    """(median fused ms, median unfused ms, median per-round fused / unfused)."""
    layers = {name: _layer(name, s, h, a, dtype) for name in BACKENDS}
    times = {name: [] for name in BACKENDS}
    for r in range(rounds + 1):
        for name in BACKENDS if r % 2 else BACKENDS[::-1]:
            hidden = _input(s, b, h, dtype)
            elapsed = _timed(lambda n=name, x=hidden: layers[n](x).float().sum().backward())
            if r:
                times[name].append(elapsed)
    ratios = [f / u for f, u in zip(times["fused"], times["unfused"])]
    return (
        statistics.median(times["fused"]) * 1e3,
        statistics.median(times["unfused"]) * 1e3,
        statistics.median(ratios),
    )


def layer_table(seqs, b, h, a, dtype_name, rounds) -> list[str]:
    """Per-rank body (one rank, TP 1): part 1's table as markdown lines."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    dtype = DTYPES[dtype_name]
    act = torch.tensor([], dtype=dtype).element_size()
    mask = _mask_bytes(dtype)
    lines = [
        f"B = {act}, M = {mask} (dropout mask bytes per element, probed); b = {b}, h = {h}, "
        f"a = {a}; linear formula sbh({16 * act + 2 * mask})",
        "",
        "| s | backend | saved MiB | formula MiB | saved / formula | fused - linear MiB | "
        "step ms | fused / unfused step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in seqs:
        sbh = s * b * h
        linear = (16 * act + 2 * mask) * sbh
        # unfused: the fp32 softmax output (and its cast to B bytes unless B = 4) + bool mask
        core = (4 + (act if act != 4 else 0)) * a * s * s * b + s * s
        fused_ms, unfused_ms, ratio = step_times(s, b, h, a, dtype, rounds) if rounds else (0,) * 3
        for name in BACKENDS:
            saved = saved_bytes(name, s, b, h, a, dtype)
            formula = linear if name == "fused" else linear + core
            beyond = f"{(saved - linear) / MIB:.2f}" if name == "fused" else ""
            ms = fused_ms if name == "fused" else unfused_ms
            label = f"sbh({16 * act + 2 * mask})"
            if name == "unfused":
                label += f" + {4 + (act if act != 4 else 0)} as^2 b + s^2"
            lines.append(
                f"| {s} | {name} | {saved / MIB:.2f} | {formula / MIB:.2f} ({label}) | "
                f"{saved / formula:.4f} | {beyond} | {ms:.0f} | "
                + (f"{ratio:.2f} |" if name == "fused" else "|")
            )
    return lines


# --- part 2: context parallelism at CP 2 ---------------------------------------------------------


def _cp_body(seq, b, a, d, rounds, dtype_name):
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(seq, b, a, d, generator=gen) for _ in range(3)]
    parts = [split_for_context_parallel(x, 0).to(device.current_device(), dtype) for x in full]
    rows = []
    for comm in ("p2p", "all_gather"):
        times = {name: [] for name in BACKENDS}
        for r in range(rounds + 1):
            for name in BACKENDS if r % 2 else BACKENDS[::-1]:
                leaves = [p.detach().requires_grad_() for p in parts]

                def step(n=name, leaves=leaves, c=comm):
                    out = context_parallel_attention(*leaves, cp_comm_type=c, backend=n)
                    out.float().sum().backward()

                dist.barrier()
                elapsed = _timed(step)
                if r:
                    times[name].append(elapsed)
        ratio = statistics.median(f / u for f, u in zip(times["fused"], times["unfused"]))
        rows.append(
            f"| {comm} | {seq} | {statistics.median(times['fused']) * 1e3:.0f} | "
            f"{statistics.median(times['unfused']) * 1e3:.0f} | {ratio:.2f} |"
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (0: bytes only)")
    parser.add_argument("--cp-seq", type=int, default=4096, help="CP 2 sequence (0: skip)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    args = parser.parse_args(argv)
    if args.device:
        device.set_device_type(args.device)
    print(f"# fused attention: {device.device_type()}, {args.dtype}, torch {torch.__version__}")
    shape = (args.seq, args.batch, args.hidden, args.heads, args.dtype, args.rounds)
    if device.device_type() == "cpu":
        lines = run_distributed(layer_table, 1, *shape, timeout=3600)[0]
    else:  # under torchrun, one rank
        dist.init_process_group(device.default_backend())
        device.set_current_device(0)
        lines = layer_table(*shape)
    print("\n".join(lines))
    if args.cp_seq and device.device_type() == "cpu":
        d = args.hidden // args.heads
        rows = run_distributed(
            _cp_body, 2, args.cp_seq, args.batch, args.heads, d, args.rounds, args.dtype,
            timeout=3600,
        )[0]  # fmt: skip
        print(f"\nCP 2, b = {args.batch}, a = {args.heads}, d = {d}, {args.rounds} rounds")
        print("| comm | s | fused ms | unfused ms | fused / unfused |\n|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
