"""The recompute planner's last step (NOTE [ Recompute planner ], rule 4): the plans that fit
and may be the fastest run side by side, and the time they measure chooses among them.

:func:`rivals` names the plans beside the search's (or megatron-core's) own that a noisy or
biased time model could have ranked wrongly; :func:`timed_choice` measures the near-budget
edges' peaks, times every candidate in rounds, runs those within 15% of the fastest as many
rounds again, then the fastest with the ones its rounds cannot yet place (neither clearly more
than 1% slower nor clearly within 1%: :func:`median_interval` of :func:`pair_ratios`) in more
sets of rounds, and keeps the fastest by its rounds paired with the others'
(:func:`paired_times`) -- unless it recomputes all another candidate does and more without being
15% faster (:func:`recomputes_all_of`) -- or, where the rounds cannot tell it within 1% from
another, the one that recomputes the smallest share of the FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from megatron_core.tensor_parallel.recompute.planner.measure import stage_max
from megatron_core.tensor_parallel.recompute.planner.probe import _find_blocks, step_peak, time_step
from megatron_core.tensor_parallel.recompute.planner.search import (
    StageMeasure,
    _megatron_candidates,
    _overhead,
    fits_when_measured,
    flop_overhead,
    one_microbatch_peak,
    predict_peak,
    search_plan,
    with_flop_costs,
    with_option_costing,
)

__all__ = [
    "rivals",
    "timed_choice",
    "recomputes_all_of",
    "paired_times",
    "CONTEST_ROUNDS",
    "CLEAR_SHARE",
    "RECHECK_SHARE",
    "COSTLIER",
    "SETTLE_BATCHES",
    "pair_ratios",
    "median_interval",
]

CONTEST_ROUNDS = 5  # rounds of the timed candidates (at least; more where ``repeats`` asks)
CLEAR_SHARE = 0.01  # a candidate whose time is this much above the fastest's is slower
RECHECK_SHARE = 0.15  # the candidates this close to the fastest run a second set of rounds
COSTLIER = 2.0  # a selective option's time, over its uniform probe's, in the costlier searches
SETTLE_BATCHES = 4  # at most this many more sets of rounds for the candidates not yet placed


def rivals(
    stage: StageMeasure, limit: int, static: int, megatron_only: bool, chosen: list[str],
    megatron: dict | None,
) -> list[dict]:  # fmt: skip
    """Plans that fit ``limit`` (bytes above ``static``) beside ``chosen`` and ``megatron``
    whose true step may be the fastest, each ``{"source", "choices", "predicted_peak",
    "overhead_ms"}`` (and ``fields`` for a megatron-core setting): every megatron-core setting
    that fits, except one that recomputes all another fitting setting does and more
    (:func:`recomputes_all_of`: its work cannot be less), whatever the time model rates it --
    a time model measured beside other work can rate a setting far above its true cost -- and,
    for a per-layer plan, the search's plan under the FLOP-share costs alone (rule 2's
    fallback) and, for each selective option ``chosen`` uses, the search's plan with that
    option costing ``COSTLIER`` times its probe's time (``"source": "costlier"``, and
    ``"option"``), where they differ."""
    found: list[dict] = []
    if megatron is not None:
        fitting = []
        for fields, choices in _megatron_candidates(stage):
            peak = predict_peak(stage, choices)
            if peak <= limit:
                fitting.append({"source": "megatron", "fields": fields, "choices": choices,
                                "predicted_peak": static + peak,
                                "overhead_ms": _overhead(stage, choices)})  # fmt: skip
        for rival in fitting:
            if rival["choices"] == megatron["choices"] or any(
                recomputes_all_of(rival["choices"], other["choices"]) for other in fitting
            ):
                continue
            found.append(rival)
    if not megatron_only:
        seen = [list(chosen)] + [rival["choices"] for rival in found]
        flops = search_plan(with_flop_costs(stage), limit)
        if flops is not None and flops[0] not in seen:
            seen.append(flops[0])
            found.append({"source": "flops", "choices": flops[0],
                          "predicted_peak": static + predict_peak(stage, flops[0]),
                          "overhead_ms": _overhead(stage, flops[0])})  # fmt: skip
        # the search again with each selective option the plan uses costing COSTLIER times its
        # uniform probe's time: recomputed among layers that keep theirs it can cost 2-4x that
        for name in dict.fromkeys(c for c in chosen if c.startswith("selective:")):
            other = search_plan(with_option_costing(stage, name, COSTLIER), limit)
            if other is not None and other[0] not in seen:
                seen.append(other[0])
                found.append({"source": "costlier", "option": name, "choices": other[0],
                              "predicted_peak": static + predict_peak(stage, other[0]),
                              "overhead_ms": _overhead(stage, other[0])})  # fmt: skip
    return found


def timed_choice(plan, chunks, forwards, repeats: int):
    """Rule 4's last step on a RecomputePlan. Each of ``plan.edges`` runs one microbatch's step
    with its choices (the stage's largest peak) and joins the candidates where
    :func:`fits_when_measured`; where the candidates (the per-layer plan, the megatron one, the
    edges that fit, the rivals) differ, each runs ``max(repeats, CONTEST_ROUNDS)`` timed steps
    (round-robin, rotated; the slowest rank's times), and a candidate's time is the median of
    its steps over the others' in the same rounds (:func:`paired_times`). The candidates within
    ``RECHECK_SHARE`` of the fastest run as many rounds again, and their times are taken again
    from all the rounds that ran them together. Then, up to ``SETTLE_BATCHES`` times, the
    fastest runs as many rounds again with each candidate within ``RECHECK_SHARE`` whose step
    over the fastest's, round by round, is neither clearly above ``1 + CLEAR_SHARE`` nor
    clearly at most that (the 95% interval of its median, :func:`median_interval`); one
    clearly above is out. The fastest left is kept; where others are within ``CLEAR_SHARE`` of
    it, the one with the least FLOP share of recompute among them (rule 2's fallback), so that
    a difference the rounds cannot see does not decide. On 2 shared cores a candidate 5.7%
    slower round by round (core attention recomputed on 5 of our GPT's 6 layers) read within
    1% of the fastest in 10 rounds often enough to be chosen, by its FLOP share, in 4 of 10
    runs; placing it costs a plan about 20 s more there. (Rounds place a plan in the planning
    process's conditions: with glibc's default malloc a CPU step's cost also moves with the
    process's history, NOTE [ Recompute planner ], rule 2.) The time model adds
    per-layer costs measured on uniform probes; a mixed plan's step can cost more than that sum
    (on a CPU, recomputing one layer's core attention beside layers that keep theirs cost 2-4x
    its uniform share), and every candidate fits the budget."""
    if repeats < 1:
        return plan
    static = 0 if plan.activations_only else plan.stage.static
    candidates = {"plan": (plan.choices, plan.predicted_peak, plan.overhead_ms)}
    megatron = plan.megatron
    megatron_dicts = {} if megatron is None else {"megatron": megatron}
    if megatron is not None:
        candidates["megatron"] = (
            megatron["choices"], megatron["predicted_peak"], megatron["overhead_ms"]
        )
    edges = []
    for edge in plan.edges:
        measured = max(_one_step_peak(chunk, forward, edge["choices"])
                       for chunk, forward in zip(chunks, forwards))  # fmt: skip
        measured = int(stage_max([float(measured)])[0])
        fits = fits_when_measured(plan.stage, edge["choices"], measured, plan.budget, static)
        one = one_microbatch_peak(plan.stage, edge["choices"])
        edges.append(dict(edge, measured_peak=measured, predicted_one=one, fits=fits))
        if fits:
            candidates["edge_" + edge["source"]] = (
                edge["choices"], edge["predicted_peak"], edge["overhead_ms"]
            )
            if edge["source"] == "megatron":
                megatron_dicts["edge_megatron"] = {k: v for k, v in edge.items() if k != "source"}
    for index, rival in enumerate(plan.rivals):
        name = f"{rival['source']}_{index}"
        candidates[name] = (rival["choices"], rival["predicted_peak"], rival["overhead_ms"])
        if rival["source"] == "megatron":
            megatron_dicts[name] = {k: v for k, v in rival.items() if k != "source"}
    distinct: dict[tuple, str] = {}
    for name, (choices, _, _) in candidates.items():
        distinct.setdefault(tuple(choices), name)
    if len(distinct) < 2:  # the megatron setting reported: the edge's where it fits (faster)
        megatron = megatron_dicts.get("edge_megatron", megatron)
        return dataclasses.replace(plan, edges=edges, megatron=megatron)
    names = list(distinct.values())
    count = max(repeats, CONTEST_ROUNDS)

    def run(which: list[str]) -> dict[str, list[float]]:
        return dict(zip(which, _rounds(chunks, forwards, [candidates[n][0] for n in which], count)))

    batches = [run(names)]
    least = paired_times(batches, names)
    close = _close(least, RECHECK_SHARE)
    if len(close) > 1:  # compare again: the close ones, as many rounds more
        batches.append(run(close))
        least.update(paired_times(batches, close))
    slower: set[str] = set()  # clearly slower than the fastest, round by round
    for settled in range(SETTLE_BATCHES + 1):  # the ones the rounds cannot yet place run again
        kept = _kept(least, candidates)
        best = min(kept, key=kept.__getitem__)
        open_ = []
        for name in _close(kept, RECHECK_SHARE):
            if name == best or name in slower:
                continue
            low, high = median_interval(pair_ratios(batches, name, best))
            if low > 1 + CLEAR_SHARE:
                slower.add(name)
            elif high > 1 + CLEAR_SHARE:
                open_.append(name)
        if not open_ or settled == SETTLE_BATCHES:
            break
        batches.append(run([best] + open_))
        least.update(paired_times(batches, [best] + open_))
    times, least = least, {name: ms for name, ms in least.items() if name not in slower}
    kept = _kept(least, candidates)
    fastest = min(least, key=least.__getitem__)
    best = min(kept, key=kept.__getitem__)
    close = _close(kept, CLEAR_SHARE)
    flops = {n: flop_overhead(plan.stage, candidates[n][0]) for n in close}
    chosen = min(close, key=lambda n: (flops[n], n != best, least[n]))
    by = "flops" if chosen != best else "time" if best == fastest else "less recompute"
    choices, peak, overhead = candidates[chosen]
    timed = {f"{name}_ms": times[name] for name in names}
    # the megatron setting reported: the chosen plan where it is one (under any name), else
    # the fastest-timed one
    ms = {name: times[distinct[tuple(candidates[name][0])]] for name in megatron_dicts}
    same = [name for name in megatron_dicts if list(candidates[name][0]) == list(choices)]
    if same:
        megatron = megatron_dicts[same[0]]
    elif ms:
        megatron = megatron_dicts[min(ms, key=ms.__getitem__)]
    return dataclasses.replace(
        plan, choices=list(choices), predicted_peak=peak, overhead_ms=overhead, timed=timed,
        edges=edges, megatron=megatron, chosen_by=by,
    )  # fmt: skip


def _kept(least: dict[str, float], candidates: dict) -> dict[str, float]:
    """``least`` without the candidates that recompute all another does and more (their work
    cannot be less) yet are not more than ``RECHECK_SHARE`` faster than it."""
    return {
        name: ms for name, ms in least.items()
        if not any(recomputes_all_of(candidates[name][0], candidates[other][0])
                   and ms * (1 + RECHECK_SHARE) > least[other] for other in least)
    }  # fmt: skip


def pair_ratios(batches: list[dict[str, list[float]]], name: str, other: str) -> list[float]:
    """``name``'s step over ``other``'s in each round of ``batches`` that ran both."""
    return [
        mine / max(theirs, 1e-9)
        for batch in batches if name in batch and other in batch
        for mine, theirs in zip(batch[name], batch[other])
    ]  # fmt: skip


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval holding the median of what ``values`` sample with at least
    ``confidence``: the k-th least and k-th greatest value, k the largest whose binomial tail
    (n = len(values), p = 1/2) below it stays within (1 - confidence) / 2 on each side (the
    sign test's interval); (-inf, inf) where too few values reach it (n < 6 at 95%)."""
    n, ordered = len(values), sorted(values)
    tail, below, k = (1 - confidence) / 2, 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return -math.inf, math.inf
    return ordered[k - 1], ordered[n - k]


def _recompute_set(choice: str) -> frozenset | None:
    """What one layer's option recomputes: the modules of a selective option, none for
    ``"none"``; None for the full options (the whole layer)."""
    if choice == "none":
        return frozenset()
    if choice.startswith("selective:"):
        return frozenset(choice.split(":", 1)[1].split("+"))
    return None


def recomputes_all_of(plan: list[str], other: list[str]) -> bool:
    """Whether ``plan`` recomputes, layer by layer, everything ``other`` does (and so does at
    least its work): the same option, or ``other``'s is none, or a selective option whose
    modules ``plan``'s selective option includes, or ``plan``'s is full (``"full_distributed"``
    includes ``"full"``)."""
    if len(plan) != len(other) or list(plan) == list(other):
        return False
    for mine, theirs in zip(plan, other):
        if mine == theirs or theirs == "none":
            continue
        kept, seen = _recompute_set(mine), _recompute_set(theirs)
        if kept is None:  # a full option
            if seen is None and not (mine == "full_distributed" and theirs == "full"):
                return False
        elif seen is None or not seen <= kept:
            return False
    return True


def _close(least: dict[str, float], share: float) -> list[str]:
    """The candidates whose time is within ``share`` of the fastest's (it included)."""
    best = min(least.values())
    return [name for name, ms in least.items() if ms <= best * (1 + share)]


def _rounds(chunks, forwards, plans: list, count: int) -> list[list[float]]:
    """Per plan, ``count`` rounds of its step's milliseconds (every chunk's microbatch summed;
    each round the slowest rank's), the plans run round-robin in a rotated order, so that the
    plans of one round run within a few seconds of each other."""
    times: list[list[float]] = [[0.0] * count for _ in plans]
    for round_ in range(count):
        for i in range(len(plans)):
            index = (i + round_) % len(plans)
            times[index][round_] = sum(
                time_step(chunk, plans[index], forward, 1)
                for chunk, forward in zip(chunks, forwards)
            )
    for chunk in chunks:
        _find_blocks(chunk)[0].set_layer_recompute(None)
    flat = stage_max([ms for plan_times in times for ms in plan_times])
    return [flat[i * count : (i + 1) * count] for i in range(len(plans))]


def paired_times(batches: list[dict[str, list[float]]], names: list[str]) -> dict[str, float]:
    """Each of ``names``' step milliseconds from rounds that paired them: in every round of
    every batch that ran all of ``names`` (``{name: [ms per round]}``), a name's step over
    the geometric mean of the names' steps in that round; a name's time is the median of its
    ratios times the median of the rounds' means. A shared machine's slow spells last seconds
    and a plan's steps drift within a process (on 2 shared cores, one step of megatron-core's
    GPTModel read 400 to 601 ms within one quiet process), so a ratio within a round, where
    the plans ran back to back, moves far less than a step: in that process selective
    core_attn (2-25% slower than full recompute of 3 layers side by side, in five processes)
    read 6% faster by the least rounds and 10% slower by paired ratios."""
    ratios: dict[str, list[float]] = {name: [] for name in names}
    means: list[float] = []
    for batch in batches:
        if not all(name in batch for name in names):
            continue
        for row in zip(*(batch[name] for name in names)):
            mean = math.exp(sum(math.log(max(ms, 1e-9)) for ms in row) / len(row))
            means.append(mean)
            for name, ms in zip(names, row):
                ratios[name].append(ms / mean)
    scale = statistics.median(means)
    return {name: statistics.median(values) * scale for name, values in ratios.items()}


def _one_step_peak(chunk, forward, choices) -> int:
    """The peak of one microbatch's forward and backward of ``chunk`` with ``choices``, above
    what was allocated before it (probe.step_peak)."""
    block = _find_blocks(chunk)[0]
    block.set_layer_recompute(choices)
    try:
        return step_peak(chunk, lambda: forward().backward())
    finally:
        block.set_layer_recompute(None)
