"""Activation memory of one GPT layer, measured, next to Korthikanti et al. 2022's formulas.

Run (CPU: each TP size on that many gloo ranks; GPU: under torchrun, one rank per GPU)::

    python scripts/benchmarks/benchmark_activation_memory.py         # fp32, cpu, tp 1 2 4
    python scripts/benchmarks/benchmark_activation_memory.py --configs 512,4,1024,16 --tp 1 2 4 8
    torchrun --nproc_per_node=1 scripts/benchmarks/benchmark_activation_memory.py --device cuda \
        --tp 1 --dtype bf16

For every (s, b, h, a), TP size t, sequence parallelism on/off and recompute none / selective
(core_attn) / the other selective modules / full / full+distributed, one forward of one
``megatron_core.transformer.TransformerLayer`` (dropout on, training mode) runs inside
``tensor_parallel.count_saved_activations`` with the layer's parameters ignored: the measured
number is the unique storage bytes autograd keeps for backward on one rank (rule 4 below). Full
recompute runs the layer through ``checkpoint_layer_stack`` (what TransformerBlock does), so the
layer's input is what is kept.

Formulas ("Reducing Activation Recomputation in Large Transformer Models", table 2), bytes per
layer with 16-bit activations and 1-byte dropout masks, ffn = 4h::

    no parallelism           sbh (34 + 5as/h)
    TP                       sbh (10 + 24/t + 5as/(ht))
    TP + SP                  sbh (34/t + 5as/(ht))
    TP + selective           sbh (10 + 24/t)
    TP + SP + selective      34 sbh / t
    full recompute           2 sbh            (2 sbh / t with SP or distributed inputs)

Adapting the constants. With B bytes per activation element and M bytes per dropout-mask element
the paper's terms are, per layer:

    attention   QKV input B, Q and K 2B, V B, projection input B, dropout mask M   (5B + M) sbh
    core attn   softmax output B, its dropout mask M, dropout output B             (2B + M) as^2 b
    MLP         fc1 input B, gelu input 4B, fc2 input 4B, dropout mask M           (9B + M) sbh
    LayerNorms  two inputs                                                         2B sbh

so no parallelism is sbh((16B + 2M) + (2B + M) as/h); with B = 2, M = 1: 34 and 5. Under TP the
LayerNorm inputs, the QKV and fc1 inputs and both hidden dropout masks stay whole, (4B + 2M) sbh
(paper: 10), and the rest is split, 12B sbh / t (paper: 24). Sequence parallelism splits all of
it. The mask bytes M are measured, not assumed: on CUDA ``F.dropout`` runs the fused
``native_dropout``, which keeps a bool mask (M = 1); on the CPU it keeps the float noise tensor it
multiplied by, in the activation dtype (M = B). Hence fp32 on the CPU (B = M = 4):

    no parallelism sbh(72 + 12as/h); TP sbh(24 + 48/t + 12as/(ht)); TP+SP sbh(72/t + 12as/(ht));
    TP + selective sbh(24 + 48/t); TP + SP + selective 72 sbh/t; full 4 sbh.

fp32 on CUDA (M = 1): 66 and 9 instead of 72 and 12; bf16 on CUDA: the paper's 34 and 5.

What the implementation keeps beyond the formulas ("extra" column; exact, per rank):

1. LayerNorm statistics: each LayerNorm keeps its mean and 1/std, one value per token each, in
   the dtype of torch's kernel (probed; fp32: 8 bytes per token, so 16 sb bytes per layer, 16 sb / t
   under SP). Not in the paper: it is O(1/h) of the rest.
2. Causal mask: ``CoreAttention`` builds a bool [s, s] mask per call and ``masked_fill`` keeps it:
   s^2 bytes, not split by TP (each rank builds its own), gone under selective recompute.
   Megatron's fused softmax kernel applies the mask without keeping it.
3. fp32 softmax: ``CoreAttention`` computes the softmax in fp32, so with 16-bit activations the
   kept softmax output costs 4 bytes per element instead of B: (4 - B) as^2 b / t more.

4. Measured is what the counted storages occupy when the forward has returned
   (``SavedActivationReport.resident_bytes``): an output that ``CheckpointWithoutOutput``
   released ("layernorm", "activation") counts 0 although autograd still references it.

Selective rows beyond the paper ("sel:mlp", "sel:layernorm", "sel:activation", "sel:all", i.e.
recompute_modules of megatron-core 0.16, "activation" being this package's extension) use the
same terms minus what the module releases (``_terms``); their formula is marked "derived".

The "unexplained" column is measured - formula - extra; anything but 0 is a finding.

Step time ("step ms", "step / none"; ``--time-rounds``, 0 to skip): one forward + backward of
the layer per mode per round, modes in an order rotated from round to round after a warm-up
round; the median time on rank 0 and the median of the per-round ratios to "none" of the same
shape and layout. On a shared machine read only the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import device, parallel_state
from megatron_core.tensor_parallel import (
    checkpoint_layer_stack,
    count_saved_activations,
    model_parallel_cuda_manual_seed,
)
from megatron_core.transformer import TransformerConfig, TransformerLayer

# "selective" is megatron-core's default selective mode (core_attn), the paper's; "sel:X" is
# recompute_modules=[X] ("all": core_attn, mlp, layernorm, activation).
RECOMPUTE = (
    "none",
    "selective",
    "sel:mlp",
    "sel:layernorm",
    "sel:activation",
    "sel:all",
    "full",
    "full+distributed",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CONFIGS = ("128,2,128,8", "256,1,256,16")
_ALL_MODULES = ["core_attn", "mlp", "layernorm", "activation"]


def recompute_modules(recompute: str) -> list[str] | None:
    """The config's recompute_modules for a selective row, None for the others."""
    if recompute == "selective":
        return ["core_attn"]
    if recompute.startswith("sel:"):
        name = recompute[4:]
        return list(_ALL_MODULES) if name == "all" else [name]
    return None


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured point: a layer shape, the parallel layout and the recompute mode."""

    s: int
    b: int
    h: int
    a: int
    tp: int
    sp: bool
    recompute: str


# --- formulas ----------------------------------------------------------------------------------


def _terms(modules: list[str], act: int, mask: int) -> tuple[int, int, bool]:
    """(bytes per sbh kept whole under TP, bytes per sbh split by TP, core attention kept).

    The paper's terms (module doc) minus what each selective module releases: "mlp" the gelu
    input and the fc2 input (its own input, the fc1 input, is what the checkpoint keeps);
    "layernorm" the two LayerNorm outputs (QKV and fc1 inputs; their inputs stay, kept by
    CheckpointWithoutOutput); "activation" the fc2 input (the gelu input stays); "core_attn"
    the core attention. The paper derives only none and core_attn; the others follow from
    the same terms.
    """
    whole = {"LayerNorm inputs": 2 * act, "QKV input": act, "fc1 input": act, "masks": 2 * mask}
    split = {"Q K V, projection input": 4 * act, "gelu input": 4 * act, "fc2 input": 4 * act}
    if "mlp" in modules:
        del split["gelu input"], split["fc2 input"]
    if "layernorm" in modules:
        del whole["QKV input"], whole["fc1 input"]
    if "activation" in modules:
        split.pop("fc2 input", None)
    return sum(whole.values()), sum(split.values()), "core_attn" not in modules


def formula_bytes(case: Case, act: int, mask: int) -> float:
    """Korthikanti et al.'s bytes per layer with ``act`` / ``mask`` bytes per element (doc)."""
    s, b, h, a, t = case.s, case.b, case.h, case.a, case.tp
    sbh = s * b * h
    if case.recompute.startswith("full"):
        return act * sbh / (t if case.sp or case.recompute == "full+distributed" else 1)
    whole, split, core_kept = _terms(recompute_modules(case.recompute) or [], act, mask)
    linear = (whole + split) * sbh / t if case.sp else whole * sbh + split * sbh / t
    core = (2 * act + mask) * a * s * s * b / t if core_kept else 0
    return linear + core


def paper_formula(case: Case) -> str:
    """The row's formula with the paper's 16-bit constants ("derived": not in the paper)."""
    if case.recompute.startswith("full"):
        split = case.sp or case.recompute == "full+distributed"
        return "2sbh/t" if split else "2sbh"
    whole, split, core_kept = _terms(recompute_modules(case.recompute) or [], 2, 1)
    core = "+5as/(ht)" if core_kept else ""
    if case.tp == 1 and not case.sp:
        text = f"sbh({whole + split}{core.replace('/(ht)', '/h')})"
    elif case.sp:
        text = f"sbh({whole + split}/t{core})"
    else:
        text = f"sbh({whole}+{split}/t{core})"
    return text if case.recompute in ("none", "selective") else f"{text} derived"


def extra_bytes(case: Case, act: int, stats_per_token: int) -> dict[str, int]:
    """What the implementation keeps beyond the formula, by cause (rules 1-3 of the module doc)."""
    if case.recompute.startswith("full"):
        return {}
    modules = recompute_modules(case.recompute) or []
    tokens = case.s * case.b // (case.tp if case.sp else 1)
    extra = {}
    if "layernorm" not in modules:  # rule 1: two LayerNorms (recomputed ones keep nothing)
        extra["LayerNorm statistics"] = 2 * stats_per_token * tokens
    if "core_attn" not in modules:
        extra["causal mask"] = case.s * case.s  # rule 2: bool [s, s]
        upcast = (4 - act) * case.a * case.s * case.s * case.b // case.tp  # rule 3
        if upcast:
            extra["fp32 softmax output"] = upcast
    return extra


def probe_bytes_per_element(dtype: torch.dtype) -> tuple[int, int]:
    """(dropout mask bytes per element, LayerNorm statistics bytes per token) on this device."""
    n = 64
    x = torch.randn(4, n, device=device.current_device(), dtype=dtype, requires_grad=True)
    with count_saved_activations() as report:
        F.dropout(x * 1.0, p=0.5, training=True)
    mask = report.total_bytes // x.numel()
    with count_saved_activations(ignore=[x]) as report:
        F.layer_norm(x, (n,))
    return mask, report.total_bytes // x.shape[0]


# --- measurement (runs on every rank) ----------------------------------------------------------


def _build_layer(case: Case, dtype: torch.dtype, dropout: float) -> TransformerLayer:
    full = case.recompute.startswith("full")
    config = TransformerConfig(
        num_layers=1,
        hidden_size=case.h,
        num_attention_heads=case.a,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        tensor_model_parallel_size=case.tp,
        sequence_parallel=case.sp,
        params_dtype=dtype,
        recompute_granularity="full" if full else recompute_modules(case.recompute) and "selective",
        recompute_modules=recompute_modules(case.recompute),
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
        distribute_saved_activations=case.recompute == "full+distributed" or None,
    )
    return TransformerLayer(config)


def _input(case: Case, dtype: torch.dtype) -> torch.Tensor:
    rows = case.s // case.tp if case.sp else case.s
    return torch.randn(
        rows, case.b, case.h, device=device.current_device(), dtype=dtype, requires_grad=True
    )


def _forward(layer: TransformerLayer, case: Case, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's forward as TransformerBlock runs it in this recompute mode."""
    if not case.recompute.startswith("full"):
        return layer(hidden)
    config = layer.config
    return checkpoint_layer_stack(
        [layer],
        hidden,
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        distribute_saved_activations=bool(config.distribute_saved_activations),
    )


def measure_layer_bytes(case: Case, dtype: torch.dtype, dropout: float) -> int:
    """Bytes one forward of one layer keeps for backward on this rank (parameters excluded)."""
    layer = _build_layer(case, dtype, dropout)
    hidden = _input(case, dtype)
    with count_saved_activations(ignore=layer.parameters()) as report:
        out = _forward(layer, case, hidden)
        kept = report.resident_bytes()  # what outlives the forward (rule 4 of the module doc)
    out.float().sum().backward()  # proves the layout runs end to end; frees the graph
    return kept


def time_cases(cases: list[Case], dtype: torch.dtype, dropout: float, rounds: int):
    """Case -> (median forward + backward ms, median of per-round ratios to "none").

    One layer per case; every round times one step of each, in an order rotated from round to
    round (the same on every rank: the steps' collectives must match), after a warm-up round.
    """
    layers = {case: _build_layer(case, dtype, dropout) for case in cases}
    times: dict[Case, list[float]] = {case: [] for case in cases}
    for r in range(rounds + 1):
        for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
            hidden = _input(case, dtype)
            start = time.perf_counter()
            _forward(layers[case], case, hidden).float().sum().backward()
            if r:
                times[case].append(time.perf_counter() - start)
    none = next(c for c in cases if c.recompute == "none")
    return {
        case: (
            statistics.median(t) * 1e3,
            statistics.median(a / b for a, b in zip(t, times[none])),
        )
        for case, t in times.items()
    }


def measure_rank(
    configs: list[tuple[int, int, int, int]], dtype_name: str, dropout: float, rounds: int
):
    """Per-rank body: every case of this TP size; returns [(Case, bytes)], the probes and the
    step times (:func:`time_cases`; empty with ``rounds`` 0)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    model_parallel_cuda_manual_seed(1234)
    dtype = DTYPES[dtype_name]
    rows, timings = [], {}
    for s, b, h, a in configs:
        for sp in (False, True) if tp > 1 else (False,):
            cases = [
                Case(s, b, h, a, tp, sp, recompute)
                for recompute in RECOMPUTE
                # megatron-core forbids full+distributed with SP: SP inputs are already split
                if not (sp and recompute == "full+distributed")
            ]
            rows += [(case, measure_layer_bytes(case, dtype, dropout)) for case in cases]
            if rounds:
                timings.update(time_cases(cases, dtype, dropout, rounds))
    return rows, probe_bytes_per_element(dtype), timings


# --- launching ---------------------------------------------------------------------------------


def _run_here(body: Callable[..., Any], tp: int, args: tuple) -> Any:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        return body(*args)
    finally:
        parallel_state.destroy_model_parallel()


def run_on_ranks(body: Callable[..., Any], tp: int, device_name: str, *args: Any) -> list[Any]:
    """``body(*args)`` on every rank of a TP group of ``tp`` ranks; returns each rank's result.

    Under torchrun (RANK set) the ranks are torchrun's (tp must divide its world size; results
    are all-gathered). Otherwise one rank runs in this process, or, for tp > 1 on the CPU, tp
    gloo ranks run through ``megatron_core.testing.run_distributed``.
    """
    device.set_device_type(device_name)
    if "RANK" in os.environ:
        if not dist.is_initialized():
            device.set_current_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(device.default_backend())
        result = _run_here(body, tp, args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return gathered
    if tp == 1:
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{Path(tmp) / 'rendezvous'}"
            dist.init_process_group(
                device.default_backend(), init_method=init, rank=0, world_size=1
            )
            try:
                return [_run_here(body, tp, args)]
            finally:
                dist.destroy_process_group()
    if device_name != "cpu":
        sys.exit(f"--tp {tp} on {device_name}: launch with torchrun --nproc_per_node={tp}")
    from megatron_core.testing import run_distributed

    return run_distributed(_on_worker, tp, body, tp, args, timeout=1800)


def _on_worker(body: Callable[..., Any], tp: int, args: tuple) -> Any:
    return _run_here(body, tp, args)


# --- output ------------------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; numbers right-aligned."""
    align = ["---:" if rows and isinstance(v, (int, float)) else "---" for v in rows[0]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def result_table(results, act, mask, stats, timings) -> tuple[str, list[str]]:
    """The markdown table and one explanation line per row off by more than 5%."""
    header = ["s", "b", "h", "a", "t", "SP", "recompute", "measured B", "formula B", "ratio",
              "paper", "extra B", "unexplained B", "step ms", "step / none"]  # fmt: skip
    rows, notes = [], []
    for case, measured in results:
        step_ms, step_ratio = timings.get(case, (float("nan"), float("nan")))
        formula = formula_bytes(case, act, mask)
        extra = extra_bytes(case, act, stats)
        ratio = measured / formula
        unexplained = measured - formula - sum(extra.values())
        rows.append(
            [case.s, case.b, case.h, case.a, case.tp, "on" if case.sp else "off", case.recompute,
             measured, round(formula), f"{ratio:.4f}", paper_formula(case), sum(extra.values()),
             round(unexplained), f"{step_ms:.1f}", f"{step_ratio:.2f}"]
        )  # fmt: skip
        if abs(ratio - 1) > 0.05:
            causes = ", ".join(f"{name} {n} B ({n / formula:.1%})" for name, n in extra.items())
            notes.append(
                f"- s,b,h,a = {case.s},{case.b},{case.h},{case.a}, t = {case.tp}, SP "
                f"{'on' if case.sp else 'off'}, {case.recompute}: ratio {ratio:.3f} = 1 + "
                f"{causes}; unexplained {round(unexplained)} B"
            )
    return markdown_table(header, rows), notes


def plot(results, path: Path) -> str:
    """A PNG of measured MiB per layer by mode and TP size (the largest configuration)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[plot]'): no PNG written"
    largest = max({(c.s, c.b, c.h, c.a) for c, _ in results}, key=lambda k: k[0] * k[1] * k[2])
    chosen = [(c, m) for c, m in results if (c.s, c.b, c.h, c.a) == largest]
    modes = sorted(
        {(c.recompute, c.sp) for c, _ in chosen}, key=lambda k: (RECOMPUTE.index(k[0]), k[1])
    )
    tps = sorted({c.tp for c, _ in chosen})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(tps)
    for i, tp in enumerate(tps):
        mib = {(c.recompute, c.sp): m / 2**20 for c, m in chosen if c.tp == tp}
        xs = [j + i * width for j in range(len(modes))]
        ax.bar(xs, [mib.get(mode, 0.0) for mode in modes], width, label=f"t={tp}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))])
    ax.set_xticklabels([f"{r}\nSP {'on' if sp else 'off'}" for r, sp in modes], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("MiB kept for backward per layer, per rank (log)")
    ax.set_title("GPT layer activation memory, s,b,h,a = {},{},{},{}".format(*largest))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def main() -> None:
    """Parse the command line, measure every layout, print and write the table (and plot)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(DEFAULT_CONFIGS),
        help="layer shapes as s,b,h,a (a and s divisible by every TP size)",
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument(
        "--time-rounds", type=int, default=5, help="timed rounds per mode (0: no step times)"
    )
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]

    results, probes, timings = [], set(), {}
    for tp in args.tp:
        per_rank = run_on_ranks(
            measure_rank, tp, args.device, configs, args.dtype, args.dropout, args.time_rounds
        )
        for rows, _, _ in per_rank[1:]:
            if [m for _, m in rows] != [m for _, m in per_rank[0][0]]:
                print(f"note: ranks of tp={tp} kept different byte counts; rank 0 is shown")
        results += per_rank[0][0]
        probes.add(per_rank[0][1])
        timings.update(per_rank[0][2])  # rank 0's clock; the ranks' steps wait on each other
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    (mask, stats), act = probes.pop(), DTYPES[args.dtype].itemsize
    table, notes = result_table(results, act, mask, stats, timings)
    title = (
        f"Activation memory per GPT layer, bytes kept for backward on one rank: "
        f"{args.device}, {args.dtype} (B = {act}, dropout mask M = {mask} bytes/element, "
        f"LayerNorm statistics {stats} bytes/token), torch {torch.__version__}"
    )
    text = "\n\n".join([title, table, "\n".join(notes) or "Every ratio is within 5%."])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"{args.device}_{args.dtype}"
    (args.out / f"activation_memory_{suffix}.md").write_text(text + "\n")
    print(plot(results, args.out / f"activation_memory_{suffix}.png"))


if __name__ == "__main__":
    # Run as the importable module, so that run_distributed pickles its functions by name.
    import benchmark_activation_memory

    benchmark_activation_memory.main()
