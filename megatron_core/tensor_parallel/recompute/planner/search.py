"""The recompute planner's prediction and search (NOTE [ Recompute planner ], rules 2-5, in
the planner's face): the measurements they read (OptionMeasure, StageMeasure), an option's time
floor and monotone costs, a plan's predicted peak, the dynamic programme over the layers, the
smallest budget that fits, the headroom kept below a budget, and the plans megatron-core's
TransformerConfig can express (rule 6)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_core.tensor_parallel.recompute.planner.megatron import megatron_fields

__all__ = [
    "OptionMeasure",
    "StageMeasure",
    "fits_when_measured",
    "flop_overhead",
    "one_microbatch_peak",
    "headroom",
    "predict_peak",
    "schedule_in_flight",
    "search_plan",
    "smallest_fit",
    "with_flop_costs",
    "with_option_costing",
]


@dataclasses.dataclass(frozen=True)
class OptionMeasure:
    """What one option costs a layer (NOTE [ Recompute planner ], rule 2): kept bytes, forward
    / backward peaks above the allocation as the layer began, what the layer's forward and
    backward leave allocated, milliseconds per step over "none", the backward peak of a
    later microbatch (its gradients exist: nothing new is allocated for them; None: taken as
    the first's), and the FLOP-share milliseconds (the share of a layer's forward FLOPs it runs
    again times a third of a layer's step: the time model's floor and its fallback)."""

    kept: int
    forward: int
    backward: int
    left: int
    extra_ms: float
    backward_later: int | None = None
    flop_ms: float = 0.0

    @property
    def later(self) -> int:
        """A later microbatch's backward peak (:attr:`backward` where it was not probed)."""
        return self.backward if self.backward_later is None else self.backward_later


@dataclasses.dataclass(frozen=True)
class StageMeasure:
    """A stage's measurements (NOTE [ Recompute planner ], rule 2); bytes above what is
    allocated as a step begins, ``static`` that itself (the allocator's total, nothing
    subtracted, plus the optimizer states its first step will make), ``states`` the model
    states among it (counted from the objects; shown, not added)."""

    layers: int
    static: int
    pre: int
    head: int
    head_left: int
    tail: int
    step_ms: float
    options: dict[str, OptionMeasure]
    spread: int = 0  # the ranks' largest difference of a uniform plan's peak (rule 5)
    grads: int = 0  # what a whole step leaves allocated: the gradients (rule 3's steady state)
    microbatches: int = 1  # microbatches of a step on this stage
    in_flight: int = 1  # microbatches whose activations the stage holds at once (rule 3)
    chunks: int = 1  # model chunks of the rank (the interleaved schedule's), one plan for all
    # the interleaved schedule (rule 3): each chunk's own measurements, and the order of the
    # rank's chunk forwards (True, c) and backwards (False, c) in one step; empty: in_flight's
    # model, every held microbatch keeping what the largest chunk keeps
    chunk_stages: tuple[StageMeasure, ...] = ()
    order: tuple[tuple[bool, int], ...] = ()
    states: int = 0  # the model states among ``static`` (rule 2)
    noise_ms: float = 0.0  # how far an option's timed rounds spread (per step, rule 2)


def headroom(stage: StageMeasure, budget: int, measured: bool = False) -> int:
    """Bytes the search keeps free below the budget (rule 5): the ranks' spread plus
    2% of the budget (what one run's numbers cannot show of another's, and a mixed plan's layers
    differing from the uniform probes' means), and 5% more where a step has several
    microbatches (rule 3's later microbatches and a pipeline schedule's own buffers are
    modelled, not probed). ``measured``: the plan's own step was measured
    (:func:`fits_when_measured`), which replaces the 2%."""
    room = stage.spread + (0 if measured else budget // 50)
    return room + (budget // 20 if stage.microbatches > 1 else 0)


def one_microbatch_peak(stage: StageMeasure, choices: Sequence[str]) -> int:
    """:func:`predict_peak` of a step of one microbatch alone (what a probe-like step of
    ``choices`` measures): the stage's numbers with one microbatch, none other held."""
    one = dataclasses.replace(stage, microbatches=1, in_flight=1, order=())
    return predict_peak(one, choices)


def fits_when_measured(
    stage: StageMeasure, choices: Sequence[str], measured: int, budget: int, static: int
) -> bool:
    """Rule 4's check of a plan near the budget: ``measured`` is the peak (above what was
    allocated before it) of one microbatch's forward and backward with ``choices``, on the
    stage's ranks the largest. Its excess over the one-microbatch prediction, where positive,
    takes the place of the 2% margin; the spread and the several-microbatch margin stay:
    ``static + predict_peak(stage, choices) + excess + headroom(measured=True) <= budget``."""
    excess = max(0, measured - one_microbatch_peak(stage, choices))
    room = headroom(stage, budget, measured=True)
    return static + predict_peak(stage, choices) + excess + room <= budget


def predict_peak(stage: StageMeasure, choices: Sequence[str]) -> int:
    """The step's predicted peak bytes above ``static`` under per-layer ``choices``
    (NOTE [ Recompute planner ], rule 3): the first microbatch's backward, and with more
    microbatches the later ones' (the gradients allocated throughout), each beside the
    other microbatches the schedule holds at once; with the interleaved schedule's ``order``,
    at every forward and backward of it, each held chunk-microbatch keeping what its chunk
    keeps."""
    if stage.order:
        return _schedule_peak(stage, choices)
    kept = sum(stage.options[c].kept for c in choices)
    others = (stage.in_flight - 1) * (stage.pre + kept)
    peak = others + _microbatch_peak(stage, choices, steady=False)
    if stage.microbatches > 1:
        peak = max(peak, others + stage.grads + _microbatch_peak(stage, choices, steady=True))
    return peak


def _schedule_peak(stage: StageMeasure, choices: Sequence[str]) -> int:
    """:func:`predict_peak` along the interleaved schedule's ``order`` (rule 3): at each
    forward of chunk c, what the held chunk-microbatches keep (each its own chunk's ``pre + K +
    head_left``) plus the gradients made so far plus chunk c's forward peak; at each backward,
    the same for the others plus chunk c's backward peak, the first on a chunk allocating its
    gradients (then counted as made), the later ones finding them there."""
    forwards = [_forward_peak(s, choices) for s in stage.chunk_stages]
    # each chunk's backward peak, (first, later), from what its forward kept
    backwards = [
        tuple(_backward_peak(s, choices, steady, kept) for steady in (False, True))
        for s, (_, kept) in zip(stage.chunk_stages, forwards)
    ]
    held, made, grads, peak = [0] * len(forwards), set(), 0, 0
    for forward, c in stage.order:
        if not forward:
            held[c] -= 1
        holding = grads + sum(n * kept for n, (_, kept) in zip(held, forwards))
        if forward:
            peak = max(peak, holding + forwards[c][0])
            held[c] += 1
            continue
        peak = max(peak, holding + backwards[c][c in made])
        if c not in made:
            made.add(c)
            grads += stage.chunk_stages[c].grads
    return peak


def schedule_in_flight(order: Sequence[tuple[bool, int]]) -> int:
    """The most chunk-microbatches a schedule ``order`` (``(forward?, chunk)`` steps) holds at
    once: at a backward, those forwarded and not yet backwarded, the one it runs included."""
    held = most = 0
    for forward, _ in order:
        if forward:
            held += 1
        else:
            most = max(most, held)
            held -= 1
    return max(most, 1)


def _forward_peak(stage: StageMeasure, choices: Sequence[str]) -> tuple[int, int]:
    """One microbatch's forward (head included): its peak above what was allocated before it,
    and what it keeps for its backward."""
    peak, kept = 0, 0
    for choice in choices:
        option = stage.options[choice]
        peak = max(peak, stage.pre + kept + option.forward)
        kept += option.kept
    return max(peak, stage.pre + kept + stage.head), stage.pre + kept + stage.head_left


def _backward_peak(stage: StageMeasure, choices: Sequence[str], steady: bool, kept: int) -> int:
    """One microbatch's backward peak above what was allocated before its forward, ``kept``
    (what its forward kept, :func:`_forward_peak`) included; ``steady`` as
    :func:`_microbatch_peak`'s."""
    live, peak = kept, 0
    for choice in reversed(choices):
        option = stage.options[choice]
        peak = max(peak, live + (option.later if steady else option.backward))
        live += (0 if steady else option.left) - option.kept
    return max(peak, live + stage.tail)


def _microbatch_peak(stage: StageMeasure, choices: Sequence[str], steady: bool) -> int:
    """One microbatch's peak above what was allocated before it; ``steady``: the gradients
    exist already (a later microbatch), so a layer's backward leaves nothing new behind."""
    forward, kept = _forward_peak(stage, choices)
    return max(forward, _backward_peak(stage, choices, steady, kept))


def _overhead(stage: StageMeasure, choices: Sequence[str]) -> float:
    return sum(stage.options[c].extra_ms for c in choices)


def flop_overhead(stage: StageMeasure, choices: Sequence[str]) -> float:
    """The FLOP-share milliseconds of ``choices``' recompute (rule 2's fallback)."""
    return sum(stage.options[c].flop_ms for c in choices)


def _with_costs(stage: StageMeasure, cost) -> StageMeasure:
    """``stage`` with each option's time ``cost(name, option)`` (its chunks' too)."""
    options = {
        name: dataclasses.replace(option, extra_ms=cost(name, option))
        for name, option in stage.options.items()
    }
    chunks = tuple(_with_costs(chunk, cost) for chunk in stage.chunk_stages)
    return dataclasses.replace(stage, options=options, chunk_stages=chunks)


def with_option_costing(stage: StageMeasure, name: str, factor: float) -> StageMeasure:
    """``stage`` with option ``name`` costing ``factor`` times its measured time (its chunks'
    too)."""
    return _with_costs(
        stage, lambda other, option: option.extra_ms * (factor if other == name else 1.0)
    )


def with_flop_costs(stage: StageMeasure) -> StageMeasure:
    """``stage`` with every option costing its FLOP share alone (its chunks' too)."""
    return _with_costs(stage, lambda name, option: option.flop_ms)


def search_plan(stage: StageMeasure, limit: int) -> tuple[list[str], int, float] | None:
    """The per-layer choices with the least predicted overhead whose predicted peak above the
    model states is at most ``limit`` bytes, as (choices, peak, overhead ms); None if none fits
    (NOTE [ Recompute planner ], rule 4)."""
    costs = {name: option.extra_ms for name, option in stage.options.items()}
    exact, stage = stage, _pruning_view(stage)
    layers, pre = stage.layers, stage.pre
    most_left = max(o.left for o in stage.options.values())
    grads = stage.grads if stage.microbatches > 1 else 0
    # state: kept bytes so far -> (overhead, choices)
    states: dict[int, tuple[float, tuple[str, ...]]] = {0: (0.0, ())}
    for j in range(layers):
        after_j = (layers - 1 - j) * most_left  # the bound on U_j (rule 4)
        grown: dict[int, tuple[float, tuple[str, ...]]] = {}
        for kept, (cost, choices) in states.items():
            for name, option in stage.options.items():
                total = kept + option.kept
                # the other microbatches held keep at least what this one kept so far (rule 4)
                others = (stage.in_flight - 1) * (pre + total)
                forward = others + grads + pre + kept + option.forward
                backward = others + pre + stage.head_left + total
                backward += max(option.backward + after_j, option.later + grads)
                if forward > limit or backward > limit:
                    continue
                if total not in grown or cost + costs[name] < grown[total][0]:
                    grown[total] = (cost + costs[name], choices + (name,))
        states = _pareto(grown)
    best = None
    for kept, (cost, choices) in states.items():
        others = (stage.in_flight - 1) * (pre + kept)
        bounded_tail = pre + stage.head_left + layers * most_left + stage.tail
        if others + max(pre + kept + stage.head + grads, bounded_tail) > limit:
            continue
        peak = predict_peak(exact, choices)
        if peak <= limit and (best is None or cost < best[2]):
            best = (list(choices), peak, cost)
    return best


def _pruning_view(stage: StageMeasure) -> StageMeasure:
    """The numbers :func:`search_plan` prunes with. Under the interleaved schedule's order the
    smallest chunk's (pre, head, tail, gradients and each option's bytes), so that the pruning
    stays at or below the walk's prediction at the events it stands for (the first backward,
    the steady phase's second forward and backward); each finished plan meets the walk itself.
    Else the stage itself."""
    if not stage.order:
        return stage
    chunks = stage.chunk_stages
    options = {
        name: OptionMeasure(
            *(min(getattr(c.options[name], f) for c in chunks)
              for f in ("kept", "forward", "backward", "left", "extra_ms")),
            min(c.options[name].later for c in chunks),
        )
        for name in stage.options
    }  # fmt: skip
    smallest = {f: min(getattr(c, f) for c in chunks)
                for f in ("pre", "head", "head_left", "tail", "grads")}  # fmt: skip
    return dataclasses.replace(stage, options=options, **smallest)


def _pareto(states: dict) -> dict:
    """Drop every state with more kept bytes and no less overhead than another."""
    kept_front, best_cost = {}, float("inf")
    for kept in sorted(states):
        if states[kept][0] < best_cost:
            kept_front[kept] = states[kept]
            best_cost = states[kept][0]
    return kept_front


def smallest_fit(stage: StageMeasure) -> tuple[int, list[str]]:
    """The smallest limit (bytes above ``static``, to 0.1%) at which :func:`search_plan`
    finds a plan, and that plan's choices (a bisection over the limit)."""
    low = 0
    high = stage.pre + stage.head + stage.head_left + stage.tail + stage.layers * max(
        o.kept + o.forward + o.backward + abs(o.left) for o in stage.options.values()
    )
    while search_plan(stage, high) is None:
        low, high = high, 2 * high
    while high - low > max(1, high // 1000):
        middle = (low + high) // 2
        if search_plan(stage, middle) is None:
            low = middle
        else:
            high = middle
    return high, search_plan(stage, high)[0]


def _megatron_candidates(stage: StageMeasure) -> list[tuple[dict, list[str]]]:
    """The plans megatron-core's TransformerConfig expresses from the stage's options (rule 6),
    as (fields, choices): one option on every layer, or full recompute of the first n."""
    layers = stage.layers
    candidates = [[o] * layers for o in stage.options if not o.startswith("full")]
    for option in ("full", "full_distributed"):
        if option in stage.options:
            candidates += [[option] * n + ["none"] * (layers - n) for n in range(1, layers + 1)]
    found = []
    for choices in candidates:
        fields = megatron_fields(choices)
        if fields is not None:
            found.append((fields, choices))
    return found


def _flop_floors(options, config, shape, layer_ms: float) -> dict[str, float]:
    """The FLOP-share fallback of an option's time (rule 2): the share of a layer's forward
    FLOPs it runs again, times a third of a layer's step (forward ~ 1/3 of forward + backward).
    Per token: linears 2 (4h^2 + 2 h f) / tp, attention 4 s h / tp (s: the keys attended)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    s = shape[0] * (tp if config.sequence_parallel else 1) * cp if shape else 1
    attention, qkv_proj, mlp = 4 * s * h, 8 * h * h, 4 * h * f
    layer = attention + qkv_proj + mlp
    elementwise = 0.01 * layer  # norms and gelu: memory-bound, not FLOP-bound; a small share
    share = {"core_attn": attention, "mlp": mlp, "activation": elementwise,
             "layernorm": elementwise}  # fmt: skip
    floors = {}
    for option in options:
        kind, _, modules = option.partition(":")
        if kind == "none":
            cost = 0.0
        elif kind.startswith("full"):
            cost = float(layer)
        else:
            cost = float(sum(share[m] for m in modules.split("+")))
        floors[option] = cost / layer * layer_ms / 3
    return floors


def _monotone(extra: dict[str, float]) -> dict[str, float]:
    """An option that recomputes everything another does costs at least as much (timing noise
    must not make full recompute look cheaper than part of it)."""

    def parts(option):
        kind, _, modules = option.partition(":")
        if kind.startswith("full"):
            return {"all"}
        return set(modules.split("+")) if modules else set()

    result = dict(extra)
    for option in extra:
        for other in extra:
            mine, theirs = parts(option), parts(other)
            if option != other and (mine == {"all"} or theirs < mine):
                result[option] = max(result[option], extra[other])
    return result
