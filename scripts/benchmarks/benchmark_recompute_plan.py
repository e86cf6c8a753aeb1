"""The recompute planner against megatron-core's hand options, at budgets from the
no-recompute peak down to the full-recompute peak.

One rank (gloo on the CPU, or NCCL on a GPU with ``--device cuda``), our GPT. Hand options are
megatron-core's TransformerConfig settings: none; selective with megatron-core's
``recompute_modules`` sets; full with the uniform method and every ``recompute_num_layers``;
full with the block method and every ``recompute_num_layers``. Their peaks above the model states
(MemoryTimeline: the profiler's allocator events on a CPU, max_memory_allocated on a GPU) set
the budgets (from 1.05 x the smallest hand peak to the no-recompute peak); the planner plans
each budget (its own probe, ``plan_recompute``). Then every hand option and every plan is
measured the same way: its peak, and its median step time (forward + backward) over
``--repeats`` rounds in which each runs once, in a rotated order (side by side: a slow spell of
the machine hits them alike). Each plan is compared with the fastest hand option whose measured
peak fits. Prints a markdown table and a text plot of step time against budget.

    python scripts/benchmarks/benchmark_recompute_plan.py                  # CPU, ~2-4 minutes
    python scripts/benchmarks/benchmark_recompute_plan.py --device cuda --layers 8 --hidden 1024 \
        --seq 2048
    python scripts/benchmarks/benchmark_recompute_plan.py --peaks-only --layers 8 --hidden 64 \
        --seq 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_core import device  # noqa: E402
from megatron_core.tensor_parallel.recompute.planner import plan_recompute  # noqa: E402
from megatron_core.tensor_parallel.recompute.planner.probe import step_peak  # noqa: E402
from scripts.checks.check_recompute_plan_cuda import one_rank_gpt  # noqa: E402

_MiB = 1 << 20
# megatron-core's recompute_modules of a dense layer ("activation" is this package's alone)
_MODULES = (
    ["core_attn"],
    ["core_attn", "mlp"],
    ["layernorm", "core_attn"],
    ["layernorm", "core_attn", "mlp"],
)


def _hand_options(layers: int) -> list[tuple[str, dict]]:
    options = [("none", {"recompute_granularity": None})]
    for modules in _MODULES:
        options.append((f"selective {'+'.join(modules)}",
                        {"recompute_granularity": "selective", "recompute_modules": modules}))
    for method in ("uniform", "block"):
        for n in range(1, layers + 1):
            options.append((f"full {method} {n}", {"recompute_granularity": "full",
                            "recompute_method": method, "recompute_num_layers": n}))
    return options  # fmt: skip


def _set_hand(model, fields: dict) -> None:
    block, config = model.decoder, model.decoder.config
    granularity = fields["recompute_granularity"]
    block.set_layer_recompute(None)
    config.recompute_granularity = "full" if granularity == "full" else None
    config.recompute_method = fields.get("recompute_method")
    config.recompute_num_layers = fields.get("recompute_num_layers")
    for layer in block.layers:
        layer.set_selective_recompute(fields.get("recompute_modules", ()) if granularity else ())


def _set_plan(model, choices) -> None:
    config = model.decoder.config
    config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None
    model.decoder.set_layer_recompute(choices)


def _peak(model, forward) -> int:
    return step_peak(model, lambda: forward().backward())


def _step_ms(model, forward) -> float:
    model.zero_grad(set_to_none=True)
    device.synchronize()
    start = time.perf_counter()
    forward().backward()
    device.synchronize()
    return (time.perf_counter() - start) * 1e3


def _measure(model, forward, setters: dict, repeats: int) -> dict[str, tuple[int, float]]:
    peaks = {}
    for name, setter in setters.items():
        setter()
        peaks[name] = _peak(model, forward)
    times = {name: [] for name in setters}
    names = list(setters)
    for round_ in range(repeats):
        for i in range(len(names)):
            name = names[(i + round_) % len(names)]
            setters[name]()
            times[name].append(_step_ms(model, forward))
    return {n: (peaks[n], sorted(times[n])[len(times[n]) // 2] if times[n] else None)
            for n in names}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budgets", type=int, default=6)
    parser.add_argument("--peaks-only", action="store_true",
                        help="print every hand option's measured peak and stop")  # fmt: skip
    args = parser.parse_args(argv)
    model, tokens, labels, own_group = one_rank_gpt(args, heads=8, vocab=4096)

    def forward():
        return model(tokens, labels).mean()

    forward().backward()  # warm-up
    hand = {n: (lambda f=f: _set_hand(model, f)) for n, f in _hand_options(args.layers)}
    hand_peaks = _measure(model, forward, hand, 0)  # peaks only: they set the budgets
    if args.peaks_only:
        print(f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}: "
              "each hand option's peak above the model states (MiB)")  # fmt: skip
        print("| hand option | peak (MiB) |\n|---|---|")
        for name, (peak, _) in hand_peaks.items():
            print(f"| {name} | {peak / _MiB:.2f} |")
        return 0
    none_peak = hand_peaks["none"][0]
    full_peak = min(p for p, _ in hand_peaks.values())
    low = full_peak * 1.05  # the planner keeps 2% of a budget free (NOTE, rule 5)
    budgets = [int(low + (none_peak - low) * i / (args.budgets - 1)) for i in range(args.budgets)]
    plans = {}
    for budget in budgets:
        try:
            plans[budget] = plan_recompute(model, forward, budget, activations_only=True,
                                           repeats=args.repeats)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - a budget the planner cannot meet is a row
            plans[budget] = str(error).split(";")[0]
    # Every hand option and every distinct plan timed in the same round-robin rounds: their
    # ratios are measured side by side.
    setters = dict(hand)
    for plan in plans.values():
        if not isinstance(plan, str):
            key = "plan " + ",".join(plan.choices)
            setters[key] = lambda choices=plan.choices: _set_plan(model, choices)
    measured = _measure(model, forward, setters, args.repeats)
    rows = []
    for budget, plan in plans.items():
        if isinstance(plan, str):
            rows.append((budget, None, None, None, plan))
            continue
        mine = measured["plan " + ",".join(plan.choices)]
        fits = [(t, n) for n, (p, t) in measured.items() if n in hand and p <= budget]
        best = min(fits) if fits else None
        counts = {c: plan.choices.count(c) for c in dict.fromkeys(plan.choices)}
        rows.append((budget, mine, best, plan.predicted_peak,
                     ", ".join(f"{k} x {c}" for c, k in counts.items())))  # fmt: skip
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: {args.layers} layers, hidden {args.hidden}, seq "
          f"{args.seq}, batch {args.batch}; peaks above the model states; step = forward + "
          f"backward, median of {args.repeats} rounds")  # fmt: skip
    print("| budget (MiB) | planner: plan | predicted (MiB) | measured (MiB) | planner (ms) | "
          "best hand option that fits | its peak (MiB) | its step (ms) | planner / hand |")
    print("|---|---|---|---|---|---|---|---|---|")
    for budget, mine, best, predicted, what in rows:
        if mine is None:
            print(f"| {budget / _MiB:.2f} | {what} | | | | | | | |")
            continue
        hand_text = "none fits" if best is None else best[1]
        hand_peak = "" if best is None else f"{measured[best[1]][0] / _MiB:.2f}"
        hand_ms = "" if best is None else f"{best[0]:.1f}"
        ratio = "" if best is None else f"{mine[1] / best[0]:.3f}"
        print(f"| {budget / _MiB:.2f} | {what} | {predicted / _MiB:.2f} | {mine[0] / _MiB:.2f} "
              f"| {mine[1]:.1f} | {hand_text} | {hand_peak} | {hand_ms} | {ratio} |")  # fmt: skip
    _plot(rows)
    if own_group:
        dist.destroy_process_group()
    return 0


def _plot(rows) -> None:
    """A text plot: one line per budget, P = the planner's step time, H = the best hand
    option's, on one scale."""
    points = [(b, m[1], h[0] if h else None) for b, m, h, _, _ in rows if m is not None]
    if not points:
        return
    top = max(max(p, h or 0) for _, p, h in points)
    print(f"\nstep time against budget (width = {top:.1f} ms; P planner, H best hand option)")
    for budget, mine, best in points:
        line = [" "] * 61
        line[round(60 * mine / top)] = "P"
        if best is not None:
            spot = round(60 * best / top)
            line[spot] = "*" if line[spot] == "P" else "H"
        print(f"{budget / _MiB:8.2f} MiB |{''.join(line)}")


if __name__ == "__main__":
    sys.exit(main())
