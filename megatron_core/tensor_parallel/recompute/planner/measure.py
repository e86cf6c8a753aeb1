"""The recompute planner's measuring: probe a stage with every option, agree across ranks.

:func:`measure_stage` runs the probe steps of NOTE [ Recompute planner ] (the planner's face),
rule 2, on one model chunk and reduces their timelines to a :class:`StageMeasure`;
:func:`measure_chunks` joins the chunks of an interleaved schedule (rule 3). The numbers every
rank plans with are the largest over the ranks of the pipeline stage (rule 5: :func:`stage_max`,
and the agreement check that raises on every rank alike).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.planner.megatron import (
    MegatronCoreBlock,
    megatron_options,
)
from megatron_core.tensor_parallel.recompute.planner.probe import (
    Probe,
    _find_blocks,
    gradient_bytes,
    model_state_bytes,
    pending_optimizer_state_bytes,
    probe_step,
    time_step,
)
from megatron_core.tensor_parallel.recompute.planner.search import (
    OptionMeasure,
    StageMeasure,
    _flop_floors,
    _monotone,
    predict_peak,
)

__all__ = [
    "candidate_options",
    "measure_stage",
    "measure_chunks",
    "stage_max",
    "allocated_before_step",
]

_SELECTIVE = (
    "selective:core_attn",
    "selective:core_attn+activation",
    "selective:layernorm+core_attn+activation",
    "selective:layernorm+core_attn+mlp",
)


def candidate_options(tensor_parallel_size: int, sequence_parallel: bool) -> list[str]:
    """The per-layer recompute options the planner weighs (NOTE [ Recompute planner ], rule 1),
    cheapest first."""
    options = ["none", *_SELECTIVE, "full"]
    if tensor_parallel_size > 1 and not sequence_parallel:
        options.append("full_distributed")
    return options


def _option_numbers(points: dict, layers: int) -> list[int]:
    """[kept, forward, backward, left, later backward] of a uniform probe (rule 2); the last
    from its second microbatch where it ran one (else the first's backward)."""
    kept = (points[f"f{layers - 1}"][0] - points["f0"][0]) // (layers - 1)
    forward = max(points[f"f{i}"][1] - points[f"f{i - 1}"][0] for i in range(1, layers))

    def backward_of(prefix: str) -> int:
        return max(
            points[f"{prefix}g{j - 1}"][1] - points[f"{prefix}g{j}"][0] for j in range(layers)
        )

    # what the layers' backward passes leave, on average (their sum is what the bound uses)
    left = (points["g-1"][0] - points[f"g{layers - 1}"][0]) // layers + kept
    later = backward_of("2:") if "2:end" in points else backward_of("")
    return [kept, forward, backward_of(""), left, later]


def _check_points(points: dict, layers: int, option: str, microbatches: int) -> None:
    wanted = [f"f{i}" for i in range(layers)] + [f"g{j}" for j in range(-1, layers)]
    wanted += ["head", "end"]
    wanted += ["2:" + name for name in wanted] if microbatches > 1 else []
    missing = [name for name in wanted if name not in points]
    if missing:
        raise MegatronCoreError(
            f"recompute planner: the probe step with {option!r} did not reach marks {missing} "
            "(does the loss depend on every layer, and does the model run in training mode?)"
        )


def measure_stage(
    model: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    optimizer=None,
    options: Sequence[str] | None = None,
    repeats: int = 3,
    microbatches: int = 1,
) -> StageMeasure:
    """Probe ``model`` (holding one TransformerBlock, in training mode) with every option
    (default :func:`candidate_options`): one measured step and ``repeats`` timed steps each,
    then agree the numbers across ranks (NOTE [ Recompute planner ], rules 2 and 5). With
    several ``microbatches`` a probe step runs two (rule 3's later microbatches)."""
    (block,) = _find_blocks(model)
    config = block.config
    layers = len(block.layers)
    if layers < 2:
        raise MegatronCoreError(
            f"recompute planner: needs at least 2 layers, the block has {layers}"
        )
    if not model.training:
        raise MegatronCoreError("recompute planner: the model must be in training mode")
    if options is None:
        offered = megatron_options if isinstance(block, MegatronCoreBlock) else candidate_options
        options = offered(config.tensor_model_parallel_size, config.sequence_parallel)
    options = list(options)
    if options[0] != "none":
        raise MegatronCoreError(f"recompute planner: options must start with 'none', got {options}")
    # warm-up: lazy state, caches, the buffers a first step makes and keeps (rule 2)
    time_step(model, ["none"] * layers, forward, 1)
    # One probe per option: on the CPU, with several ranks too, the timeline sees every free
    # (NOTE [ Frees the CPU profiler records ]), so a probe repeats to within 0.3%.
    probes, shapes, times = {}, {}, {option: [] for option in options}
    probed = min(microbatches, 2)
    for option in options:
        probe = _probe_kept_buffers_first(model, [option] * layers, forward, probed)
        probes[option], shapes[option] = probe.points, probe.shape
        _check_points(probes[option], layers, option, probed)
    numbers = _stage_numbers(model, optimizer, probes, options, layers)
    for round_ in range(repeats):  # round-robin, rotated: a slow spell hits every option alike
        for i in range(len(options)):
            option = options[(i + round_) % len(options)]
            times[option].append(time_step(model, [option] * layers, forward, 1))
    block.set_layer_recompute(None)
    local = _stage(layers, options, numbers, [0.0] * len(options))
    peaks = [predict_peak(local, [o] * layers) for o in options]
    numbers, spread = _agree(numbers, peaks, options)
    step_ms, deltas, noise = _paired(times, options)
    floors = _flop_floors(options, config, shapes["none"], step_ms / layers)
    extra = {o: max(floors[o], deltas[o] / layers) for o in options}
    extra = _monotone(extra)
    return _stage(
        layers, options, numbers, [extra[o] for o in options], step_ms, spread,
        [floors[o] for o in options], noise,
    )  # fmt: skip


def _paired(times: dict[str, list[float]], options) -> tuple[float, dict[str, float], float]:
    """From each option's timed rounds (each round the slowest rank's): the "none" step's
    least round, each option's least round minus that (a shared machine only ever adds to a
    step's work: another hardware thread on the core, the caches; the least round is the one
    closest to the step's own), and the noise: the most any option's median round lies above
    its least (rule 2)."""
    flat = stage_max([ms for option in options for ms in times[option]])
    count = len(times[options[0]])
    rounds = {o: sorted(flat[i * count : (i + 1) * count]) for i, o in enumerate(options)}
    none = rounds["none"][0]
    deltas = {option: rounds[option][0] - none for option in options}
    noise = max(r[len(r) // 2] - r[0] for r in rounds.values())
    return none, deltas, noise


def _probe_kept_buffers_first(model, choices, forward, microbatches: int) -> Probe:
    """A probe step with ``choices``; where it left more than 1% of its peak allocated after
    its gradients were dropped (a buffer the option's step made and keeps, which the warm-up's
    did not need: rule 2), probed once more, that buffer now counted before the step."""
    probe = probe_step(model, choices, forward, microbatches)
    if probe.left > probe.peak // 100:
        probe = probe_step(model, choices, forward, microbatches)
    return probe


def allocated_before_step(model, optimizer=None) -> tuple[int, int]:
    """What is allocated as a training step begins (rule 2's ``static``), and of it the model
    states: the allocator's total with the model's gradients dropped, nothing subtracted
    (``device.allocated_bytes``: model and optimizer states, the buffers the model or its
    libraries made at a first step and keep, the data, whatever else is alive), plus the
    optimizer states its first step will make (``pending_optimizer_state_bytes``); the model
    states as counted from the objects (``model_state_bytes``), that same pending part
    included. Garbage in reference cycles is collected first."""
    model.zero_grad(set_to_none=True)
    gc.collect()  # cyclic garbage not yet collected is no state of a step (probe.MemoryTimeline)
    device.synchronize()
    pending = pending_optimizer_state_bytes(optimizer)
    return device.allocated_bytes() + pending, model_state_bytes(model, optimizer) + pending


def _stage_numbers(model, optimizer, probes: dict, options, layers: int) -> list[int]:
    """The byte numbers of the probes (rule 2), in StageMeasure's order."""
    none = probes["none"]
    kept = _option_numbers(none, layers)[0]
    last = none[f"f{layers - 1}"][0]
    static, states = allocated_before_step(model, optimizer)
    numbers = [
        static,
        none["f0"][0] - kept,  # pre
        max(none["head"][1], none[f"g{layers - 1}"][1]) - last,  # head
        none[f"g{layers - 1}"][0] - last,  # head_left
        none["end"][1] - none["g-1"][0],  # tail
        gradient_bytes(model),  # grads: what a step's backward allocates and keeps
        states,
    ]
    for option in options:
        numbers += _option_numbers(probes[option], layers)
    return numbers


def _stage(
    layers, options, numbers, extra, step_ms=0.0, spread=0, flops=None, noise=0.0
) -> StageMeasure:
    flops = flops or [0.0] * len(options)
    measures = {
        option: OptionMeasure(*numbers[7 + 5 * i : 11 + 5 * i], extra[i], numbers[11 + 5 * i],
                              flops[i])  # fmt: skip
        for i, option in enumerate(options)
    }
    static, pre, head, head_left, tail, grads, states = numbers[:7]
    return StageMeasure(
        layers, static, pre, head, head_left, tail, step_ms, measures, spread, grads=grads,
        states=states, noise_ms=noise,
    )  # fmt: skip


def _agree(numbers: list[int], peaks: list[int], options: Sequence[str]) -> tuple[list, int]:
    """Rule 5: every rank's predicted peak of each option on all layers within 25% of the
    others'; then the largest of each number, on every rank, and the headroom's spread: the
    ranks' largest difference of those peaks."""
    group = _stage_group()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return numbers, 0
    where = device.current_device()
    high = torch.tensor(peaks + numbers, dtype=torch.float64, device=where)
    low = high.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    spread = 0
    for option, hi, lo in zip(options, high.tolist(), low.tolist()):
        if hi - lo > 0.25 * hi:
            raise MegatronCoreError(
                f"recompute planner: the ranks' probe steps disagree: with {option!r} on every "
                f"layer their peaks range from {int(lo):,} to {int(hi):,} bytes (ranks of one "
                "layout must run the same step)"
            )
        spread = max(spread, int(hi - lo))
    return [int(x) for x in high.tolist()[len(peaks) :]], spread


def stage_max(values: list[float]) -> list[float]:
    """The largest of each of ``values`` over the ranks of this rank's pipeline stage (an
    all_reduce MAX; the slowest time, the largest byte count): what every rank of the stage
    plans with (rule 5). Collective over :func:`_stage_group`."""
    group = _stage_group()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return values
    where = device.current_device()
    values = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.tolist()


def _stage_group():
    """The ranks that share this rank's pipeline stage (tensor x data x context parallel), which
    agree on one plan (rule 5); the default group where parallel_state is not initialized."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return None


def measure_chunks(
    chunks: Sequence[torch.nn.Module],
    forwards: Sequence[Callable[[], torch.Tensor]],
    optimizer=None,
    options: Sequence[str] | None = None,
    repeats: int = 3,
    microbatches: int = 1,
) -> StageMeasure:
    """:func:`measure_stage` of each of this rank's model chunks (one, or the interleaved
    schedule's), as one StageMeasure for the plan they share (rule 3): the largest of each
    byte number (where no schedule order is given, a held chunk-microbatch is taken to keep
    what the largest keeps), each chunk's own measurements (``chunk_stages``, which the
    order's prediction reads), the gradients of all of them, each option's time summed over
    the chunks (per microbatch), and the model states of all chunks and ``optimizer`` counted
    once (the stage's largest)."""
    stages = [
        measure_stage(c, f, None, options, repeats, microbatches) for c, f in zip(chunks, forwards)
    ]
    everything = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
    static, states = allocated_before_step(everything, optimizer)  # every chunk's, once
    static, states = (int(x) for x in stage_max([float(static), float(states)]))
    first = stages[0]
    if len(stages) == 1:
        return dataclasses.replace(first, static=static, states=states)
    options = {
        name: OptionMeasure(
            *(max(getattr(s.options[name], f) for s in stages)
              for f in ("kept", "forward", "backward", "left")),
            sum(s.options[name].extra_ms for s in stages),
            max(s.options[name].backward_later for s in stages),
            sum(s.options[name].flop_ms for s in stages),
        )
        for name in first.options
    }  # fmt: skip
    return StageMeasure(
        first.layers, static, *(max(getattr(s, f) for s in stages)
                                for f in ("pre", "head", "head_left", "tail")),
        sum(s.step_ms for s in stages), options, max(s.spread for s in stages),
        grads=sum(s.grads for s in stages), chunks=len(stages), chunk_stages=tuple(stages),
        states=states, noise_ms=sum(s.noise_ms for s in stages),
    )  # fmt: skip
