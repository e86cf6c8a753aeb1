"""The recompute planner's entry points: :func:`plan_recompute` probes the model, chooses and
times; :func:`choose_plan` chooses from measurements; :func:`parse_memory_budget` reads a budget;
:func:`in_flight_microbatches` counts what a 1F1B stage holds (NOTE [ Recompute planner ] in the
planner's face)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import get_rng_snapshot, set_rng_snapshot
from megatron_core.tensor_parallel.recompute.planner.contest import rivals, timed_choice
from megatron_core.tensor_parallel.recompute.planner.measure import measure_chunks
from megatron_core.tensor_parallel.recompute.planner.megatron import MegatronCoreBlock
from megatron_core.tensor_parallel.recompute.planner.probe import _find_blocks
from megatron_core.tensor_parallel.recompute.planner.recompute_plan import RecomputePlan
from megatron_core.tensor_parallel.recompute.planner.search import (
    StageMeasure,
    _megatron_candidates,
    _overhead,
    headroom,
    predict_peak,
    schedule_in_flight,
    search_plan,
    smallest_fit,
)

__all__ = ["plan_recompute", "choose_plan", "parse_memory_budget", "in_flight_microbatches"]

_MiB = 1 << 20
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip
def parse_memory_budget(budget, total_bytes: int | None = None) -> int:
    """Bytes of a budget: an int, or text such as "2GiB", "1.5 GB", "512MiB", "3e9", or a
    percentage ("80%") of ``total_bytes`` (default: the device's memory, on a CPU the
    machine's). Raises MegatronCoreError naming the value when it is none of these."""
    if isinstance(budget, bool):
        raise MegatronCoreError(f"memory budget {budget!r} is not a size")
    if isinstance(budget, int):
        value = budget
    else:
        text = str(budget).strip().lower().replace(" ", "")
        percent = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
        sized = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)([a-z]*)", text)
        if percent:
            share = float(percent.group(1))
            if not 0 < share <= 100:
                raise MegatronCoreError(f"memory budget {budget!r}: a share must be in (0, 100]%")
            value = int(share / 100 * (total_bytes or device.total_memory()))
        elif sized and sized.group(2) in _UNITS:
            value = int(float(sized.group(1)) * _UNITS[sized.group(2)])
        else:
            raise MegatronCoreError(
                f"memory budget {budget!r} is not a size (e.g. 2GiB, 512MB, 3e9) or a share "
                "of the device's memory (e.g. 80%)"
            )
    if value <= 0:
        raise MegatronCoreError(f"memory budget {budget!r} must be above 0 bytes")
    return value


def in_flight_microbatches(microbatches: int) -> int:
    """Microbatches whose activations this rank's pipeline stage holds at once under 1F1B
    (NOTE [ Recompute planner ], rule 3): min(pp - stage, microbatches); 1 without pipeline
    parallelism."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return min(pp - parallel_state.get_pipeline_model_parallel_rank(), microbatches)




def plan_recompute(
    model,
    forward,
    budget,
    optimizer=None,
    activations_only: bool = False,
    options: Sequence[str] | None = None,
    repeats: int = 3,
    microbatches: int = 1,
    in_flight: int | None = None,
    schedule: Sequence[tuple[bool, int]] | None = None,
) -> RecomputePlan:
    """Probe ``model`` and choose per layer the recompute with the least predicted time whose
    predicted peak fits ``budget`` (NOTE [ Recompute planner ]). The RNG streams (CPU, device,
    tracker) are restored after the probe steps.

    Args:
        model: a module holding one TransformerBlock (our GPTModel, one pipeline stage's chunk
            of it, or megatron-core's GPTModel), in training mode, on this rank's device; under
            the interleaved schedule the list (or ModuleList) of this rank's chunks, which get
            one plan (rule 3). Every rank of the layout calls this together (collectives within
            each pipeline stage).
        forward: runs one microbatch's forward and returns a scalar whose backward is the
            step's, as the training loop does it (autocast, loss scaling included): the loss;
            on a pipeline stage without the loss, e.g. the output times a gradient-shaped
            tensor, summed, and the stage's input made inside ``forward`` (rule 3). One per
            chunk (a list) with several chunks.
        budget: bytes per rank (:func:`parse_memory_budget`: "2GiB", "80%", an int).
        optimizer: the optimizer whose states count towards the model states (before its
            first step, what they will take: ``pending_optimizer_state_bytes``), or None.
        activations_only: the budget bounds the step's peak above what is allocated as it
            begins (``static``) only.
        options: the options to weigh (default :func:`candidate_options`).
        repeats: timed steps per option.
        microbatches: microbatches per step (gradient accumulation; under pipeline
            parallelism the schedule's microbatches: 1F1B holds up to pp - stage of them).
        in_flight: the chunk-microbatches whose activations the schedule holds at once on this
            rank (default :func:`in_flight_microbatches`, 1F1B's); needed with several chunks:
            the interleaved schedule's warm-up forwards plus one
            (``pipeline_parallel.interleaved_warmup_microbatches(...) + 1``); with
            ``schedule`` it is read from there.
        schedule: with several chunks, the order of this rank's chunk forwards ``(True, c)``
            and backwards ``(False, c)`` in one step (``pipeline_parallel.
            interleaved_chunk_order(...)``): the prediction then follows it, each held
            chunk-microbatch keeping what its own chunk keeps (rule 3); without it every held
            one is taken to keep what the largest chunk keeps.

    Raises:
        MegatronCoreError: a budget that is not a size, a layout the planner cannot probe,
            ranks whose probes disagree, or a budget no plan fits (naming the smallest that
            fits and what it recomputes), on every rank alike.
    """
    limit_total = parse_memory_budget(budget)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise MegatronCoreError(f"recompute planner: microbatches ({microbatches!r}) must be >= 1")
    chunks, forwards = _chunks_of(model, forward, in_flight, schedule)
    order = _check_schedule(schedule, len(chunks), microbatches)
    if order and in_flight is None:
        in_flight = schedule_in_flight(order)
    if in_flight is None:
        in_flight = in_flight_microbatches(microbatches)
    elif isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise MegatronCoreError(f"recompute planner: in_flight ({in_flight!r}) must be >= 1")
    rng = get_rng_snapshot()  # the probe steps' dropout draws leave the training's streams be
    try:
        stage = measure_chunks(chunks, forwards, optimizer, options, repeats, microbatches)
    finally:
        set_rng_snapshot(rng)
    stage = dataclasses.replace(
        stage, microbatches=microbatches, in_flight=in_flight, order=order
    )
    megatron_only = isinstance(_find_blocks(chunks[0])[0], MegatronCoreBlock)
    try:
        plan, failure = choose_plan(stage, limit_total, activations_only, megatron_only), None
    except MegatronCoreError as error:
        plan, failure = None, str(error)
    _raise_if_any_failed(failure)
    rng = get_rng_snapshot()
    try:
        return timed_choice(plan, chunks, forwards, repeats)
    finally:
        set_rng_snapshot(rng)


def _raise_if_any_failed(failure: str | None) -> None:
    """Every rank raises where any stage's plan failed (stages plan alone, rule 5): the first
    failing rank's message, so no rank trains on while another stops."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if failure is not None:
            raise MegatronCoreError(failure)
        return
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    for rank, message in enumerate(failures):
        if message is not None:
            where = "" if rank == dist.get_rank() else f" (rank {rank})"
            raise MegatronCoreError(message + where)


def _check_schedule(schedule, chunks: int, microbatches: int) -> tuple:
    """``schedule`` as a tuple of ``(bool, int)`` (empty for None), checked before any
    collective: each of the ``chunks`` runs ``microbatches`` forwards and as many backwards,
    no backward before its forward."""
    if schedule is None:
        return ()
    order = tuple(schedule) if isinstance(schedule, (list, tuple)) else None
    bad = order is None or chunks < 2 or any(
        not isinstance(step, (list, tuple)) or len(step) != 2 or not isinstance(step[0], bool)
        or isinstance(step[1], bool) or not isinstance(step[1], int)
        or not 0 <= step[1] < chunks for step in order
    )  # fmt: skip
    if not bad:
        order = tuple((forward, chunk) for forward, chunk in order)
        held = [0] * chunks
        for forward, chunk in order:
            held[chunk] += 1 if forward else -1
            bad = bad or held[chunk] < 0
        counts = [sum(1 for f, c in order if f and c == chunk) for chunk in range(chunks)]
        bad = bad or any(held) or counts != [microbatches] * chunks
    if bad:
        shown = repr(schedule) if len(repr(schedule)) <= 120 else repr(schedule)[:117] + "..."
        raise MegatronCoreError(
            f"recompute planner: schedule {shown} is not an order of {chunks} chunk(s)' "
            f"{microbatches} forwards (True, chunk) and backwards (False, chunk) each, every "
            "backward after its forward (pipeline_parallel.interleaved_chunk_order gives one)"
        )
    return order


def _chunks_of(model, forward, in_flight, schedule) -> tuple[list, list]:
    """The rank's chunks and their forwards; several only under the interleaved schedule."""
    several = isinstance(model, (list, tuple, torch.nn.ModuleList))
    chunks = list(model) if several else [model]
    forwards = list(forward) if isinstance(forward, (list, tuple)) else [forward]
    if not chunks or len(forwards) != len(chunks):
        raise MegatronCoreError(
            f"recompute planner: {len(chunks)} model chunk(s) and {len(forwards)} forward(s): "
            "one forward per chunk"
        )
    blocks = [_find_blocks(chunk)[0] for chunk in chunks]
    vp = blocks[0].config.virtual_pipeline_model_parallel_size
    if (vp or 1) != len(chunks):
        raise MegatronCoreError(
            f"recompute planner: virtual_pipeline_model_parallel_size ({vp}) and "
            f"{len(chunks)} model chunk(s): under the interleaved schedule pass every chunk of "
            "this rank (a list), with a forward for each"
        )
    if len(chunks) > 1:
        layers = {len(block.layers) for block in blocks}
        if len(layers) != 1:
            raise MegatronCoreError(
                f"recompute planner: the chunks hold {sorted(layers)} layers; one plan for "
                "every chunk needs the same number"
            )
        if in_flight is None and schedule is None:
            raise MegatronCoreError(
                "recompute planner: under the interleaved schedule pass schedule, the order "
                "this rank runs its chunks in (pipeline_parallel.interleaved_chunk_order(...)), "
                "or in_flight, the chunk-microbatches it holds at once"
            )
    return chunks, forwards


def choose_plan(
    stage: StageMeasure, budget, activations_only: bool = False, megatron_only: bool = False
) -> RecomputePlan:
    """The plan for measured ``stage`` within ``budget`` (:func:`plan_recompute` after its
    probe): the per-layer choices with the least predicted time whose predicted peak fits
    (rule 4), and the fastest plan megatron-core's TransformerConfig expresses (rule 6). With
    ``megatron_only`` (a megatron-core model, whose layers take one setting) the plan is that
    one. Raises MegatronCoreError where nothing fits, naming the smallest budget that does."""
    limit_total = parse_memory_budget(budget)
    static = 0 if activations_only else stage.static
    limit = limit_total - static - headroom(stage, limit_total)
    megatron = _best_megatron(stage, limit, static)
    if megatron_only:
        if megatron is None:
            raise MegatronCoreError(_no_fit_message(stage, limit_total, static, True))
        choices, overhead = megatron["choices"], megatron["overhead_ms"]
        peak = megatron["predicted_peak"] - static
    else:
        found = search_plan(stage, limit)
        if found is None:
            raise MegatronCoreError(_no_fit_message(stage, limit_total, static))
        choices, peak, overhead = found
    # Rule 4: faster plans that fit only without the 2% margin, for plan_recompute to measure.
    near = limit_total - static - headroom(stage, limit_total, measured=True)
    edges = []
    edge = _best_megatron(stage, near, static)
    if edge is not None and (megatron is None or edge["overhead_ms"] < megatron["overhead_ms"]):
        edges.append(dict(edge, source="megatron"))
    found = None if megatron_only else search_plan(stage, near)
    if found is not None and found[2] < overhead:
        edges.append({"choices": found[0], "predicted_peak": static + found[1],
                      "overhead_ms": found[2], "source": "plan"})  # fmt: skip
    others = rivals(stage, limit, static, megatron_only, choices, megatron)
    return RecomputePlan(
        choices, limit_total, activations_only, static + peak, overhead, stage.step_ms,
        megatron, stage, edges=edges, rivals=others,
    )  # fmt: skip


def _best_megatron(stage: StageMeasure, limit: int, static: int) -> dict | None:
    """The megatron-core setting (rule 6) with the least predicted overhead whose predicted
    peak above ``static`` is at most ``limit``, or None."""
    best = None
    for fields, candidate in _megatron_candidates(stage):
        candidate_peak = predict_peak(stage, candidate)
        if candidate_peak > limit:
            continue
        cost = _overhead(stage, candidate)
        if best is None or cost < best["overhead_ms"]:
            best = {"fields": fields, "predicted_peak": static + candidate_peak,
                    "overhead_ms": cost, "choices": candidate}  # fmt: skip
    return best


def _no_fit_message(
    stage: StageMeasure, budget: int, static: int, megatron_only: bool = False
) -> str:
    if megatron_only:
        fields, choices = min(_megatron_candidates(stage), key=lambda c: predict_peak(stage, c[1]))
        limit = predict_peak(stage, choices)
    else:
        limit, choices = smallest_fit(stage)
    fits = static + limit + headroom(stage, 2 * (static + limit))
    counts = {c: choices.count(c) for c in dict.fromkeys(choices)}
    what = ", ".join(f"{n} x {c}" for c, n in counts.items())
    if megatron_only:
        what += " (megatron-core TransformerConfig: " + ", ".join(
            f"{k}={v!r}" for k, v in fields.items()) + ")"  # fmt: skip
    return (
        f"recompute planner: no plan fits the budget of {budget:,} bytes "
        f"({budget / _MiB:,.1f} MiB); the smallest that fits is {fits:,} bytes "
        f"({fits / _MiB:,.1f} MiB, allocated as a step begins {static / _MiB:,.1f} MiB), "
        f"recomputing {what}"
    )
