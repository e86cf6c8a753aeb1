"""The recompute planner on a GPU: predicted peak against ``torch.cuda.max_memory_allocated``.

One process (NCCL, world size 1): our GPT (8 layers, hidden 1024, sequence 2048, micro batch
4, bf16 autocast) and AdamW after one step; the planner probes it, then for budgets from the
no-recompute peak down to the smallest plan that fits, each emitted plan runs one forward and
backward, and its peak, the allocator's total with nothing subtracted (``max_memory_allocated``
after ``reset_peak_memory_stats``; on the CPU ``planner.probe.step_total_peak``), is printed beside
the prediction.
Exits non-zero when a measured peak exceeds its budget or differs from the prediction by more
than 5%. ``--device cpu --layers 3 --hidden 64 --seq 128 --batch 2`` is a CPU dry run.

    python scripts/checks/check_recompute_plan_cuda.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_core import device, parallel_state  # noqa: E402
from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_core.tensor_parallel.recompute.planner import (  # noqa: E402
    headroom,
    measure_stage,
    predict_peak,
    search_plan,
    smallest_fit,
)
from megatron_core.tensor_parallel.recompute.planner.probe import step_total_peak  # noqa: E402
from megatron_core.transformer import GPTModel, TransformerConfig  # noqa: E402

_MiB = 1 << 20


def one_rank_gpt(args, heads: int, vocab: int):
    """World size 1 (NCCL on ``args.device == "cuda"``, else gloo; a harness's group if one is
    up), parallel_state, and our GPT (``args.layers``, ``args.hidden``, ``heads``, ``vocab``,
    sequence ``args.seq``, dropout 0.1) on the device with a fixed [``args.batch``,
    ``args.seq``] batch: (model, tokens, labels, whether this call made the group)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    device.set_device_type(args.device)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(3)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
        hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=args.device == "cpu",
    )  # fmt: skip
    model = GPTModel(config, vocab, args.seq).to(device.current_device())
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
                      .to(device.current_device()) for _ in range(2))  # fmt: skip
    return model, tokens, labels, own_group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    model, tokens, labels, own_group = one_rank_gpt(args, heads=16, vocab=32768)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kind = "cuda" if args.device == "cuda" else "cpu"

    def forward():
        with torch.autocast(kind, dtype=torch.bfloat16):
            return model(tokens, labels).float().mean()

    forward().backward()
    optimizer.step()  # Adam's moments exist: the model states are what they will be
    optimizer.zero_grad(set_to_none=True)
    stage = measure_stage(model, forward, optimizer, repeats=2)
    none_peak = predict_peak(stage, ["none"] * stage.layers)
    smallest, _ = smallest_fit(stage)
    smallest += headroom(stage, 2 * smallest)
    name = torch.cuda.get_device_name(0) if kind == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}: {args.layers} layers, hidden {args.hidden}, seq "
          f"{args.seq}, batch {args.batch}, bf16 autocast; allocated as a step begins "
          f"{stage.static / _MiB:,.1f} MiB (model states {stage.states / _MiB:,.1f} MiB)")
    print("| budget (MiB) | plan | predicted (MiB) | measured (MiB) | error |")
    print("|---|---|---|---|---|")
    failed = False
    for share in (None, 0.75, 0.5, 0.25, 0.0):
        if share is None:
            limit = none_peak + headroom(stage, 2 * none_peak)
        else:
            limit = int(smallest + share * (none_peak - smallest))
        choices, predicted, _ = search_plan(stage, limit - headroom(stage, limit))
        limit, predicted = stage.static + limit, stage.static + predicted  # totals
        model.decoder.set_layer_recompute(choices)
        optimizer.zero_grad(set_to_none=True)
        if kind == "cuda":  # torch.cuda.max_memory_allocated over the step, nothing subtracted
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            forward().backward()
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated()
        else:
            measured = step_total_peak(model, lambda: forward().backward())
        error = (predicted - measured) / measured
        bad = measured > limit or abs(error) > 0.05
        failed |= bad
        counts = {c: choices.count(c) for c in dict.fromkeys(choices)}
        plan = ", ".join(f"{n} x {c}" for c, n in counts.items())
        print(f"| {limit / _MiB:,.1f} | {plan} | {predicted / _MiB:,.1f} | {measured / _MiB:,.1f}"
              f" | {error:+.1%}{' FAIL' if bad else ''} |")  # fmt: skip
    if own_group:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
