"""The recompute planner's prediction over a grid of our GPT's layouts on CPU ranks (gloo).

For each layout (world size, TP, SP, CP, sequence, precision, microbatches per step): the ranks
build our GPT (3 layers, hidden 64, 4 heads, batch 2), probe it (``measure_stage``), and plan at
three budgets: the no-recompute peak, halfway, and the smallest that fits. Each plan then runs
one step (``microbatches`` forward + backward passes, the gradients accumulating) under the
allocator timeline; the table gives the largest |predicted - measured| over the ranks and the
three plans, and whether every measured peak fit its budget. Bytes are above the model states.

    python scripts/checks/check_recompute_plan_grid.py             # the whole grid, ~10 minutes
    python scripts/checks/check_recompute_plan_grid.py --only 0 3  # rows 0 and 3
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts._ranks import run_ranks  # noqa: E402

_VOCAB, _BATCH, _LAYERS, _HIDDEN = 128, 2, 3, 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row of the grid (picklable: it travels to the ranks)."""

    world: int
    tp: int = 1
    sp: bool = False
    cp: int = 1
    seq: int = 256  # the whole sequence (each CP rank holds seq / cp)
    bf16: bool = False
    microbatches: int = 1


GRID = [
    Layout(1, seq=256),
    Layout(1, seq=1024),
    Layout(1, seq=2048),
    Layout(1, seq=1024, bf16=True),
    Layout(1, seq=256, microbatches=4),
    Layout(2, tp=2, seq=512),
    Layout(2, tp=2, sp=True, seq=512),
    Layout(2, tp=2, seq=512, bf16=True, microbatches=4),
    Layout(2, cp=2, seq=512),
    Layout(4, tp=4, seq=512),
    Layout(4, tp=4, sp=True, seq=512),
    Layout(4, tp=2, cp=2, seq=512),
]


def _rank(rank: int, layout: Layout, port: int, queue) -> None:
    from megatron_core import parallel_state
    from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron_core.tensor_parallel.recompute.planner import (
        headroom,
        in_flight_microbatches,
        measure_stage,
        predict_peak,
        search_plan,
        smallest_fit,
    )
    from megatron_core.tensor_parallel.recompute.planner.probe import step_peak
    from megatron_core.transformer import GPTModel, TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=layout.world)
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, context_parallel_size=layout.cp
    )
    model_parallel_cuda_manual_seed(5)
    config = TransformerConfig(
        num_layers=_LAYERS, hidden_size=_HIDDEN, num_attention_heads=4,
        tensor_model_parallel_size=layout.tp, context_parallel_size=layout.cp,
        sequence_parallel=layout.sp, hidden_dropout=0.1,
        attention_dropout=0.0 if layout.cp > 1 else 0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, _VOCAB, layout.seq)
    local = layout.seq // layout.cp
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, _VOCAB, (_BATCH, local), generator=gen)
    labels = torch.randint(0, _VOCAB, (_BATCH, local), generator=gen)
    cast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if layout.bf16 else contextlib.nullcontext()
    )

    def forward():
        with cast:
            return model(tokens, labels).float().mean() / layout.microbatches

    stage = measure_stage(model, forward, repeats=1)
    m = layout.microbatches
    stage = dataclasses.replace(stage, microbatches=m, in_flight=in_flight_microbatches(m))
    none_peak = predict_peak(stage, ["none"] * _LAYERS)
    smallest, _ = smallest_fit(stage)
    smallest += headroom(stage, 2 * smallest)
    rows = []
    for limit in (none_peak + headroom(stage, 2 * none_peak), (smallest + none_peak) // 2,
                  smallest):  # fmt: skip
        choices, predicted, _ = search_plan(stage, limit - headroom(stage, limit))
        model.decoder.set_layer_recompute(choices)
        measured = step_peak(model, lambda: [forward().backward() for _ in range(m)])
        rows.append((limit, choices, predicted, measured))
    gathered = [None] * layout.world if rank == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def _describe(layout: Layout) -> str:
    parts = [f"TP {layout.tp}" + (" SP" if layout.sp else ""), f"CP {layout.cp}",
             f"seq {layout.seq}", "bf16 autocast" if layout.bf16 else "fp32",
             f"{layout.microbatches} microbatch{'es' if layout.microbatches > 1 else ''}"]
    return ", ".join(parts)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, nargs="*", help="grid rows to run (default: all)")
    args = parser.parse_args(argv)
    rows = args.only if args.only else range(len(GRID))
    print("| row | ranks | layout | plans (no recompute / half / smallest) | largest error "
          "| within budget |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        layout = GRID[row]
        per_rank = run_ranks(_rank, layout.world, layout)
        errors, fits, plans = [], True, []
        for i in range(3):
            limit, choices, predicted, _ = per_rank[0][i]
            measured = max(rank_rows[i][3] for rank_rows in per_rank)
            errors.append((predicted - measured) / measured)
            fits = fits and all(rank_rows[i][3] <= limit for rank_rows in per_rank)
            counts = {c: choices.count(c) for c in dict.fromkeys(choices)}
            plans.append(" + ".join(f"{n} {c}" for c, n in counts.items()))
        worst = max(errors, key=abs)
        print(f"| {row} | {layout.world} | {_describe(layout)} | {' / '.join(plans)} "
              f"| {worst:+.1%} ({', '.join(f'{e:+.1%}' for e in errors)}) "
              f"| {'yes' if fits else 'NO'} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
