"""Pipeline schedules: activation bytes per stage and bubble fraction, measured vs. theory.

Run (CPU, each pipeline size on that many gloo ranks)::

    python scripts/benchmarks/benchmark_pipeline.py                       # pp 1 2 4, vp none/2, m 8
    python scripts/benchmarks/benchmark_pipeline.py --pp 2 4 --microbatches 4 8 16 --forward-ms 20
    python scripts/benchmarks/benchmark_pipeline.py --bubble --forward-ms 200 --repeats 5 \
        --plot docs/benchmarks/pipeline_bubble.png   # idle share only

``--bubble`` times only sleeping chunks (below, point 2) for 1F1B and the interleaved schedule
blocking, with ``overlap_p2p_comm`` and with ``overlap_p2p_comm_warmup_flush``, at pp=4 v=2 m=16
and 8, pp=2 v=2 m=8 and pp=4 v=2 m=10 (microbatch group 5; ``--cases pp:vp:m[:group]`` picks
others), ``--repeats`` timed steps each after one untimed, and prints the median and best idle
share against theory (``--plot``: a bar chart, matplotlib from the ``plot`` extra).

For each (pp, vp, m) a GPT of ``--num-layers`` layers is split into pp stages (pp * vp chunks)
and one training step runs through ``get_forward_backward_func()`` twice:

1. Memory: inside ``count_saved_activations`` (parameters ignored). ``peak`` is the most bytes
   autograd held at once on the stage during the step (NOTE [ Saved-activation accounting ],
   rule 3); ``in flight`` divides it by one microbatch's forward bytes through the stage's
   chunks (measured alone, first), so it counts microbatches whose activations are alive at once.
2. Time: the same schedule runs chunks whose work is sleeping (``forward_ms / vp`` per chunk
   forward, twice that per backward; the tensors exchanged are tiny), so a stage's planned work
   per step is m * 3 * forward_ms whatever the machine's load (sleeping needs no CPU). ``idle``
   is 1 - planned work / wall time of the step (slowest stage): the bubble plus what is not
   planned work (the p2p exchanges' latency, waking up on a loaded machine). Theory, for the
   bubble alone: 1F1B (pp - 1) / (m + pp - 1), interleaved (pp - 1) / (vp * m + pp - 1)
   (Narayanan et al. 2021, section 2.2). ``p2p s`` is the stage's time inside p2p calls and
   ``exchanges`` their number: interleaving makes vp times as many, each paying the latency.

The numbers go to stdout as a markdown table (copied into docs/benchmarks/pipeline.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_core import parallel_state  # noqa: E402
from megatron_core.pipeline_parallel import P2PCommunicator, get_forward_backward_func  # noqa: E402
from megatron_core.pipeline_parallel.interleaved import (  # noqa: E402
    interleaved_warmup_microbatches,
)
from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_core.tensor_parallel.recompute.memory import count_saved_activations  # noqa: E402
from megatron_core.testing import run_distributed  # noqa: E402
from megatron_core.transformer import GPTModel, TransformerConfig  # noqa: E402

VOCAB = 256


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _TimedP2P(P2PCommunicator):
    """P2PCommunicator that counts its exchanges and adds their wall time to ``waited``."""

    waited, exchanges = 0.0, 0

    def _communicate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super()._communicate(*args, **kwargs)
        finally:
            self.waited += time.perf_counter() - start
            self.exchanges += 1


def _build(opts, pp, vp):
    config = TransformerConfig(
        num_layers=opts.num_layers,
        hidden_size=opts.hidden_size,
        num_attention_heads=opts.num_attention_heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    chunks = []
    for c in range(vp or 1):
        first = parallel_state.is_pipeline_first_stage() and c == 0
        last = parallel_state.is_pipeline_last_stage() and c == (vp or 1) - 1
        chunks.append(GPTModel(config, VOCAB, opts.seq_length, first, last, vp and c))
    return config, chunks


def _step_func(opts, sleep: tuple[float, float] | None):
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, VOCAB, (opts.micro_batch_size, opts.seq_length + 1), generator=g)
    tokens, labels = text[:, :-1], text[:, 1:]

    def forward_step(data_iterator, model):
        next(data_iterator)
        out = model(tokens, labels if model.post_process else None)
        if sleep is not None:
            out = _Sleep.apply(out, *sleep) * 1.0

        def loss_func(per_token):
            loss = per_token.mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    return forward_step


def _schedule(chunks, opts, m, step_func, p2p=None):
    vp = len(chunks) > 1 or parallel_state.get_virtual_pipeline_model_parallel_world_size()
    get_forward_backward_func()(
        forward_step_func=step_func,
        data_iterator=[iter(range(m)) for _ in chunks] if vp else iter(range(m)),
        model=chunks if vp else chunks[0],
        num_microbatches=m,
        seq_length=opts.seq_length,
        micro_batch_size=opts.micro_batch_size,
        p2p_communicator=p2p,
    )


def _one_microbatch_bytes(chunks, opts, config) -> int:
    step = _step_func(opts, None)
    total = 0
    for chunk in chunks:
        if not chunk.pre_process:
            shape = (opts.seq_length, opts.micro_batch_size, opts.hidden_size)
            chunk.set_input_tensor([torch.randn(shape, requires_grad=True)])
        with count_saved_activations(ignore=chunk.parameters()) as report:
            out, loss_func = step(iter([0]), chunk)
            if chunk.post_process:
                loss_func(out)
        total += report.total_bytes
    return total


class _SleepChunk(torch.nn.Module):
    """A chunk whose work is sleeping: [4, b, 8] through one tiny Linear, then ``_Sleep``."""

    SHAPE = (4, 1, 8)

    def __init__(self, pre_process, post_process, sleep, **options):
        super().__init__()
        self.config = types.SimpleNamespace(
            pipeline_dtype=torch.float32,
            hidden_size=self.SHAPE[-1],
            sequence_parallel=False,
            **options,
        )
        self.pre_process, self.post_process, self.sleep = pre_process, post_process, sleep
        self.linear = torch.nn.Linear(self.SHAPE[-1], self.SHAPE[-1])
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self, x):
        h = x if self.pre_process else self.input_tensor
        return _Sleep.apply(self.linear(h), *self.sleep) * 1.0


def _sleep_step(data_iterator, model):
    next(data_iterator)
    out = model(torch.ones(_SleepChunk.SHAPE))
    return out, lambda output: (output.mean(), {})


def _sleep_chunks(opts, vp, **options) -> list:
    """This stage's ``vp or 1`` sleeping chunks, a forward of ``opts.forward_ms`` per stage
    (split among its chunks) and a backward of twice that."""
    sleep = (opts.forward_ms / 1e3 / (vp or 1), 2 * opts.forward_ms / 1e3 / (vp or 1))
    chunks = []
    for c in range(vp or 1):
        first = parallel_state.is_pipeline_first_stage() and c == 0
        last = parallel_state.is_pipeline_last_stage() and c == (vp or 1) - 1
        chunks.append(_SleepChunk(first, last, sleep, **options))
    return chunks


def _run_step(chunks, vp, m, **schedule) -> float:
    """Wall seconds of one step of the schedule over ``chunks`` (``m`` microbatches), after a
    barrier; ``schedule``: further arguments of the forward-backward function."""
    dist.barrier()
    start = time.perf_counter()
    get_forward_backward_func()(
        forward_step_func=_sleep_step,
        data_iterator=[iter(range(m)) for _ in chunks] if vp else iter(range(m)),
        model=chunks if vp else chunks[0],
        num_microbatches=m,
        seq_length=_SleepChunk.SHAPE[0],
        micro_batch_size=_SleepChunk.SHAPE[1],
        **schedule,
    )
    return time.perf_counter() - start


def _time_schedule(opts, pp, vp, m) -> tuple[float, float, int]:
    """(p2p seconds, wall seconds, exchanges) of one step of sleeping chunks."""
    chunks = _sleep_chunks(opts, vp)
    p2p = _TimedP2P(parallel_state.get_pipeline_model_parallel_group(), chunks[0].config)
    wall = _run_step(chunks, vp, m, p2p_communicator=p2p if pp > 1 else None)
    dist.barrier()
    return p2p.waited, wall, p2p.exchanges


def _measure(opts, pp, vp, ms):
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
    )
    model_parallel_cuda_manual_seed(1234)
    config, chunks = _build(opts, pp, vp)
    per_microbatch = _one_microbatch_bytes(chunks, opts, config)
    params = [p for c in chunks for p in c.parameters()]
    rows = []
    for m in ms:
        with count_saved_activations(ignore=params) as report:
            _schedule(chunks, opts, m, _step_func(opts, None))
        waited, wall, exchanges = _time_schedule(opts, pp, vp, m)
        peak = report.peak_held_bytes
        rows.append((m, peak, peak / per_microbatch, waited, wall, exchanges))
    return rows


def _theory(pp, vp, m):
    if pp == 1:
        return 0.0
    return (pp - 1) / ((vp or 1) * m + pp - 1)


def _expected_in_flight(pp, vp, m, rank):
    if vp is None:
        return min(pp - rank, m)
    total = m * vp
    return min(interleaved_warmup_microbatches(m, pp, rank, vp) + 1, total) / vp


# --- bubble mode (--bubble): idle share of 1F1B and interleaved schedules vs theory ------------

# (pp, vp, m, microbatch_group_size_per_vp_stage); m=10 at pp=4 is not divisible by pp.
BUBBLE_CASES = [(4, 2, 16, None), (4, 2, 8, None), (2, 2, 8, None), (4, 2, 10, 5)]
SCHEDULES = {  # name: (interleaved?, config options)
    "1F1B": (False, {}),
    "interleaved, blocking p2p": (True, {}),
    "interleaved, overlap_p2p_comm": (True, {"overlap_p2p_comm": True, "batch_p2p_comm": False}),
    "interleaved, overlap + warmup_flush": (
        True,
        {"overlap_p2p_comm": True, "batch_p2p_comm": False, "overlap_p2p_comm_warmup_flush": True},
    ),
}


def _bubble_walls(opts, pp, vp, m, options, repeats) -> list[float]:
    """Per-rank body: wall seconds of ``repeats`` steps of sleeping chunks (after one untimed)."""
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
    )
    chunks = _sleep_chunks(opts, vp, **options)
    walls = [_run_step(chunks, vp, m) for _ in range(repeats + 1)]
    return walls[1:]


def _bubble_rows(opts):
    """One row per (case, schedule): idle share (median and best of the repeats) vs theory."""
    rows = []
    for pp, vp, m, group in opts.cases or BUBBLE_CASES:
        for name, (interleaved, options) in SCHEDULES.items():
            options = dict(options)
            if interleaved and group is not None:
                options["microbatch_group_size_per_vp_stage"] = group
            v = vp if interleaved else None
            per_rank = run_distributed(
                _bubble_walls, pp, opts, pp, v, m, options, opts.repeats, timeout=600
            )
            walls = [max(w[i] for w in per_rank) for i in range(opts.repeats)]
            idle = [1 - m * 3 * opts.forward_ms / 1e3 / wall for wall in walls]
            rows.append(
                (pp, v, m, group if interleaved else None, name)
                + (statistics.median(idle), min(idle), _theory(pp, v, m))
            )
    return rows


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((pp, m) for pp, _, m, *_ in rows))
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(SCHEDULES)
    for j, name in enumerate(SCHEDULES):
        xs = [i + (j - (len(SCHEDULES) - 1) / 2) * width for i in range(len(cases))]
        measured = [r[5] for r in rows if r[4] == name]
        theory = [r[7] for r in rows if r[4] == name]
        ax.bar(xs, measured, width * 0.95, label=f"{name} (measured)")
        ax.scatter(xs, theory, marker="_", s=300, color="black", zorder=3)
    ax.scatter([], [], marker="_", s=300, color="black", label="theory")
    groups = {(pp, m): g for pp, _, m, g, *_ in rows if g}
    ax.set_xticks(
        range(len(cases)),
        [
            f"pp={pp}, m={m}" + (f", group {groups[pp, m]}" if (pp, m) in groups else "")
            for pp, m in cases
        ],
    )
    ax.set_ylabel("idle share of the step")
    ax.set_title("Pipeline idle share, fixed-time chunks (interleaved: vp=2)")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(r[5] for r in rows) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _case(text: str) -> tuple:
    parts = [int(x) for x in text.split(":")]
    return tuple(parts + [None] * (4 - len(parts)))


def bubble_main(opts) -> None:
    print(
        f"Sleeping chunks: forward {opts.forward_ms:g} ms + backward {2 * opts.forward_ms:g} ms "
        f"per microbatch and stage (split over vp chunks); {opts.repeats} timed steps, median\n"
    )
    print("| pp | vp | m | group | schedule | idle (median) | idle (best) | theory | excess |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = _bubble_rows(opts)
    for pp, vp, m, group, name, median, best, theory in rows:
        print(
            f"| {pp} | {vp or '-'} | {m} | {group or '-'} | {name} | {median:.3f} | {best:.3f} "
            f"| {theory:.3f} | {median - theory:+.3f} |"
        )
    if opts.plot:
        _plot(rows, opts.plot)
        print(f"\nplot: {opts.plot}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--vp", type=int, default=2, help="virtual size for the interleaved rows")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--bubble", action="store_true", help="only the idle-share table")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row (--bubble)")
    parser.add_argument("--plot", default=None, help="PNG path for the --bubble plot")
    parser.add_argument(
        "--cases",
        type=_case,
        nargs="+",
        default=None,
        help="--bubble cases pp:vp:m[:group] (default: the four of BUBBLE_CASES)",
    )
    opts = parser.parse_args(argv)
    if opts.bubble:
        bubble_main(opts)
        return
    print(
        f"GPT {opts.num_layers} layers, h {opts.hidden_size}, s {opts.seq_length}, "
        f"b {opts.micro_batch_size}, fp32, CPU/gloo; per microbatch and stage: forward "
        f"{opts.forward_ms:g} ms + backward {2 * opts.forward_ms:g} ms of sleep\n"
    )
    print(
        "| schedule | pp | vp | m | stage | peak saved KiB | in flight (expected) "
        "| exchanges | p2p s | step s | idle | bubble theory |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pp in opts.pp:
        for vp in [None] if pp == 1 else [None, opts.vp]:
            if vp is not None and (
                opts.num_layers % (pp * vp) or any(m % pp for m in opts.microbatches)
            ):
                continue
            name = "no pipelining" if pp == 1 else ("interleaved" if vp else "1F1B")
            per_rank = run_distributed(_measure, pp, opts, pp, vp, opts.microbatches, timeout=600)
            for i, m in enumerate(opts.microbatches):
                wall = max(rows[i][4] for rows in per_rank)
                idle = 1 - m * 3 * opts.forward_ms / 1e3 / wall
                for rank, rows in enumerate(per_rank):
                    _, peak, in_flight, waited, _, exchanges = rows[i]
                    expected = _expected_in_flight(pp, vp, m, rank) if pp > 1 else 1
                    print(
                        f"| {name} | {pp} | {vp or '-'} | {m} | {rank} | {peak / 1024:.1f} "
                        f"| {in_flight:.2f} ({expected:g}) | {exchanges} | {waited:.2f} | "
                        + (
                            f"{wall:.2f} | {idle:.3f} | {_theory(pp, vp, m):.3f} |"
                            if rank == 0
                            else "| | |"
                        )
                    )


if __name__ == "__main__":
    main()
