"""Loss drift of --bf16 / --fp16 training against fp32, per iteration, on the same data and seed.

Runs scripts/train_gpt.py's engine (megatron_core.training.train) in worker processes for each
(precision, TP size) and prints a markdown table: max and final |loss - fp32 loss| over the run,
and the final losses. Every run starts from the same fp32 weights (CPU initialization, rounded to
the half dtype for bf16/fp16) and draws the same batches and dropout masks.

    python scripts/benchmarks/precision_drift.py                # 50 iterations, TP 1 and 2 (SP)
    python scripts/benchmarks/precision_drift.py --iters 20 --tp 1              # shorter
    python scripts/benchmarks/precision_drift.py --device cuda --tp 1  # a GPU (TP ranks need GPUs)

Results go in docs/benchmarks/mixed-precision.md. Only loss values are compared; no timing.
"""

from __future__ import annotations

import argparse
import os

from megatron_core.testing import run_distributed
from megatron_core.training import parse_args, train

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-warmup-iters", "5", "--log-interval", "1000",
]  # fmt: skip


def _losses(argv: list[str]) -> dict[int, float]:
    return train(parse_args(argv)).losses


def run(iters: int, tp_sizes: list[int], device_type: str) -> list[dict]:
    """One row per (precision, TP size): drift of its losses from fp32's at the same TP size."""
    rows = []
    for tp in tp_sizes:
        parallel = ["--tensor-model-parallel-size", str(tp)]
        if tp > 1:
            parallel.append("--sequence-parallel")
        base = [*MODEL, *parallel, "--train-iters", str(iters), "--device", device_type]
        losses = {}
        for precision in ("fp32", "bf16", "fp16"):
            flags = [] if precision == "fp32" else [f"--{precision}"]
            losses[precision] = run_distributed(_losses, tp, base + flags, timeout=900)[0]
        for precision in ("bf16", "fp16"):
            diffs = [abs(losses[precision][i] - losses["fp32"][i]) for i in losses["fp32"]]
            rows.append(
                {
                    "precision": precision,
                    "tp": tp,
                    "max_drift": max(diffs),
                    "final_drift": diffs[-1],
                    "final_fp32": losses["fp32"][iters],
                    "final": losses[precision][iters],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":  # the harness's CUDA mode: one GPU per rank, NCCL
        os.environ["MEGATRON_CORE_TEST_DEVICE"] = "cuda"
    rows = run(args.iters, args.tp, args.device)
    print(f"\n{args.iters} iterations, model {' '.join(MODEL)}, device {args.device}\n")
    print("| precision | TP (SP if > 1) | max abs drift | final abs drift | final fp32 | final |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['precision']} | {r['tp']} | {r['max_drift']:.4f} | {r['final_drift']:.4f} "
            f"| {r['final_fp32']:.4f} | {r['final']:.4f} |"
        )


if __name__ == "__main__":
    main()
