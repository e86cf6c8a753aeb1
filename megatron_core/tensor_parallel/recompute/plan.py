"""A memory budget in, the fastest recompute plan that fits out.

Example (our GPT; ``forward`` returns the scalar loss of one microbatch)::

    from megatron_core.tensor_parallel.recompute.plan import plan_recompute

    plan = plan_recompute(model, lambda: model(tokens, labels).mean(), "2GiB", optimizer)
    print(plan)          # per-layer choices, predicted peak and overhead, megatron-core fields
    plan.apply(model)    # TransformerBlock.set_layer_recompute(plan.choices)

# NOTE [ Recompute planner ]
1. Options. Each layer of the model's TransformerBlock gets one of :func:`candidate_options`:
   "none"; selective recompute of megatron-core's modules ("selective:core_attn",
   "+activation", "+layernorm", or "mlp" whole); "full" (the layer is one checkpoint, only its
   input kept: megatron-core's full recompute, block method, one layer); "full_distributed"
   (that input split over the TP group; TP > 1 without sequence parallelism).
2. Measure, do not guess. For every option, one probe step of the user's own model, data,
   layout and precision with that option on every layer runs under a :class:`MemoryTimeline`
   (plan_probe.py: ``max_memory_allocated`` on CUDA, the profiler's allocator events on the
   CPU) with marks after each layer's forward, after the loss, and as each layer's backward
   begins and ends. From them, per option o: ``k_o`` the bytes one layer keeps for backward
   (the step between consecutive layers' forward marks), ``fwd_o`` / ``bwd_o`` the most a
   layer's forward / backward (recompute included) allocates above what was allocated as it
   began, and ``u_o`` what a layer's forward and backward together leave allocated (its
   parameters' gradients; under autocast also weight casts a recompute made). From the "none"
   probe: ``pre`` (kept before the first layer: embeddings, inputs), the head (final norm,
   logits, loss: its peak above the last layer's mark, and what it leaves for the backward)
   and the tail (embedding backward). Each option's step is timed in ``repeats`` rounds, run
   round-robin over the options in a rotated order, as the step's work on this rank
   (``device.StepTimer``: this thread's CPU time on the CPU, CUDA events on a GPU), which
   other processes on a shared machine do not move as they move the wall clock (beside two
   busy loops on 2 cores a wall-clock plan swapped to one 1.16x slower). CPU time moves with a
   shared machine too, but only upwards (a core's other hardware thread, the caches: on 2
   shared cores one option's median cost read 7 ms in one process and 20 ms in the next), so
   ``t_o`` is an option's least round; an option costs ``(t_o - t_none) / L`` per layer, at
   least its share of a layer's forward FLOPs times a third of a layer's step (``flop_ms``:
   the fallback where timing cannot see it), and at least what any option recomputing less of
   the layer costs. How far an option's median round lies above its least is the stage's
   timing noise (``noise_ms``, rule 4), and rule 4 times the plans that could be the fastest
   side by side. ``static``, what is
   allocated as a step begins, is the allocator's total after the probes with the gradients
   dropped, nothing subtracted (``device.allocated_bytes``: ``memory_allocated`` on CUDA, a
   census of the live storages on the CPU), plus the optimizer states its first step will
   make where it has not stepped (``pending_optimizer_state_bytes``): the model and optimizer
   states, the data, and the buffers the model or its libraries made at the warm-up step and
   keep for good (megatron-core's global memory buffer, the ``[b * np, s, s]`` scores its
   local attention hands ``baddbmm``: 2 GiB in fp32 at s = 4096, 32 heads per rank, b = 1).
   They are counted where the probe finds them allocated, from no list of known buffers; a
   probe step that leaves more than 1% of its peak allocated (a buffer its option needs and
   the warm-up's did not) runs once more with the buffer there. The model states counted from
   the objects (``model_state_bytes``) are shown beside it. A budget bounds that total at the
   step's peak, what ``max_memory_allocated`` reads after a reset on a GPU.
3. Prediction. With K_j the kept bytes of layers 0..j and U_j what layers j+1.. left after
   their backward, the step's peak above ``static`` is the largest of
   ``pre + K_{j-1} + fwd_{o_j}`` (layer j's forward), ``pre + K_{L-1} + head``, ``pre +
   head_left + K_j + U_j + bwd_{o_j}`` (layer j's backward: layers after j have freed what
   they kept) and the tail after layer 0's backward. Layers of one block are alike: an
   option's kept and left bytes are the means over the probed layers, its forward and backward
   peaks the largest. With m > 1 microbatches a step has two kinds of them: the first, as
   above, and the later ones, which run with every gradient G already allocated (the
   ``.grad`` tensors the first backward made, counted from the parameters) and leave nothing
   new behind their layers' backward (u counts 0): G plus that microbatch's peak, its layers'
   backward peaks measured (with m > 1 every probe step runs a second microbatch, the
   gradients accumulating: ``OptionMeasure.backward_later``, which allocates no gradient; the
   first's peak overstated a later one's by up to 6.8% on the last 1F1B stage). Under 1F1B
   pipeline parallelism stage i of p holds w = min(p - i, m) microbatches at once
   (:func:`in_flight_microbatches`): each of the w - 1 others keeps ``pre + K_{L-1}``, added to
   both kinds. Under the interleaved schedule a rank runs vp model chunks of L layers each;
   every chunk is probed, and one plan serves all of them (:func:`measure_chunks`: each
   chunk's own numbers, and for the time model the times summed). The caller passes the
   order the schedule runs the rank's chunks in, ``schedule`` (from
   ``pipeline_parallel.interleaved_chunk_order``: this family does not import the
   schedules), and the prediction walks it: at every forward and backward, what the held
   chunk-microbatches keep (each its own chunk's ``pre + K + head_left``: the first chunk
   keeps the embedding's, a later one its received input), plus the gradients of the chunks
   whose first backward has run, plus that chunk's forward or backward peak (first or later
   kind). At most its warm-up forwards plus one are held. Taking every held one to keep what
   the largest chunk keeps (what ``in_flight`` alone gives) read up to 6.4% above the step on
   stage 0 with full recompute, where ``pre`` is most of what a layer keeps; the order's walk
   -2.7% to +4.7% (the measured step itself varying by 4.5% between runs). The search prunes
   with the smallest chunk's numbers and rule 4's in-flight count (at most what the walk reads
   at the first backward and at the steady phase's second forward and backward, where the
   others held number the warm-up forwards) and checks each finished plan with the walk. A
   stage is probed alone: its ``forward`` makes the stage's input itself (a stage after the
   first) and returns the output times a gradient-shaped tensor, summed (a stage before the
   last), so one probe measures what one microbatch keeps there; the schedule's own buffers
   (received gradients, sends in flight) are not probed: the schedule holds nothing of a
   microbatch past its backward (NOTE [ Pipeline outputs ], rule 5), and what its buffers add
   stays within 1% of a stage's peak on the CPU; the headroom keeps 5% more where a step has
   several microbatches (rule 5). Where it can be wrong: a forward whose allocations depend on
   the data, allocator caching and fragmentation on CUDA (``max_memory_allocated`` counts live
   tensors, not reserved memory), autocast's weight-cast cache (held to the end of the
   forward, whatever recomputes), timing noise.
4. Search. Dynamic programming over the layers with K (the kept bytes so far) as the state: a
   state with more kept bytes and no less time is dropped (it can only meet later bounds less
   easily), and the cost is a sum over layers. The backward terms also depend on the layers
   after j through U_j, bounded in the search by (L - 1 - j) times the largest u (u differs
   little between options: gradients are the same); the chosen plan's own prediction is
   exact, and at most the bound. Without that bound the search would be exact. The states
   per layer are at most the distinct sums of L options' k (a few thousand for the layer
   counts and option sets here). Rule 3's other microbatches and gradients grow with the
   final K: a state is dropped when even its kept-so-far breaks the limit with them (the
   final K is at least that), and each finished plan is checked against its exact prediction.
   No plan fits: the error names the smallest budget that fits (a bisection over the budget) and
   what that plan recomputes. Last, the plans that fit and could be the fastest are timed side by
   side (plan_contest.py): the search's plan, the fastest megatron-core setting that fits (rule 6),
   its rivals (``RecomputePlan.rivals``: the megatron-core settings predicted within 1.5x of its
   overhead plus twice the noise, at most two, the one that recomputes the least FLOP share, which a
   time model measured beside other work can rate far too high, and the search's plan under the
   FLOP-share costs alone) and the near-budget edges below. Where they differ, each runs at least 5
   rounds of one step, round-robin in a rotated order (the slowest rank's times), those within 15%
   of the fastest by its least round run as many rounds again, and the fastest by its least round of
   all is the plan (``RecomputePlan.timed``), unless it recomputes all that another candidate does
   and more (full where the other keeps a layer, or more modules of it): its work cannot be less, so
   it is kept only where it was more than 15% faster, and otherwise the fastest of the rest is the
   plan (on 2 shared cores a step of megatron-core's GPTModel with full recompute of 3 layers read
   4-9% faster than with 2 in the contest's rounds of 2 of 8 quiet processes, and 6% slower side by
   side); where others are within 1% of it, the one with the least FLOP share of recompute among
   them, so that a difference the rounds cannot see is decided by what does not move
   (``RecomputePlan.chosen_by``). The time model is a sum of per-layer costs from uniform probes,
   and a mixed plan's step can cost more than that sum (on a CPU one layer's core-attention
   recompute among layers that keep theirs cost 2-4x its uniform share), so the plan is never
   clearly slower than megatron-core's best that fits as measured there. Near the budget, rule 5's
   2% margin can shut out a faster plan that does fit (megatron-core's "none" at a budget just above
   its peak): the search and the megatron settings are weighed again without the margin, each such
   plan predicted faster than its guarded counterpart (``RecomputePlan.edges``) runs one
   microbatch's step, and it joins the timed candidates where its prediction, plus what that
   measured step exceeded its one-microbatch prediction by, plus the rest of the headroom fits
   (``plan_search.fits_when_measured``): the measurement of the plan itself stands in for the
   margin.
5. Agreement. Ranks probe their own step; each rank's predicted peak with each option on every
   layer is compared (all_reduce MIN and MAX over the default group) and must agree within 25%
   (one layout, one shape per rank; ranks differ a little legitimately, more so in a small
   model: a context-parallel ring's first rank skips blocks the others compute, the check
   window's agreements run on some ranks' collectives only): otherwise every rank raises the same
   error, naming the option and the range. The plan then uses the largest of every byte
   number and the slowest times, so every rank computes the same plan, and keeps a headroom
   below the budget: the ranks' largest difference plus 2% of the budget (a mixed
   plan's layers differ a little from the uniform probes' means: up to 1.4% under on one CPU
   rank), plus 5% where a step has several microbatches (rule 3's model of the later ones and
   of a pipeline schedule: up to 3.3% under on one CPU rank, 1.0% on pipeline stage 0)
   (:func:`headroom`). The ranks that agree are those of one pipeline stage (its
   tensor x data x context parallel group): each stage has its own plan.
   One probe per option is enough with several CPU ranks too: the collectives see to it that
   the timeline records every free (NOTE [ Frees the CPU profiler records ], in
   parallel_state/handed.py); before they did, gloo's worker thread freed some of their
   tensors unseen and the same step read up to 8% apart from run to run.
6. megatron-core. Its TransformerConfig expresses one recompute for all layers: none, selective
   with one ``recompute_modules`` set (of core_attn, layernorm, mlp: "activation" is this
   package's alone), or full with uniform / block and ``recompute_num_layers`` (with
   ``distribute_saved_activations``). :attr:`RecomputePlan.megatron` is the fastest of those
   that fits by the same prediction (block method: the first n layers full, the rest none), as
   TransformerConfig fields, with its predicted peak and overhead beside the per-layer plan's.
   The uniform method with n > 1 (one checkpoint per n layers) is not weighed: it recomputes
   what n = 1 does (every layer's forward once more), so it is never faster, and it keeps L/n
   inputs instead of L but holds n layers' activations while a group recomputes, so it needs
   less memory than n = 1 only where L/2 inputs outweigh a layer's activations: beyond 34 +
   5as/h layers on one stage with megatron's per-layer count (our GPT, 8 layers, hidden 64,
   seq 256: 20.1 MiB at n = 1, 34.1 at n = 2, +14.1 MiB each n more;
   docs/benchmarks/recompute-planner.md).
   megatron-core's own GPTModel (built through the switch) is probed the same way: its block is
   seen through plan_megatron.MegatronCoreBlock, which sets each option in place (the config's
   full-recompute fields, read at every forward; the layers' selective flags, which its
   TransformerConfig would have set when they were built) and sets the marks with module hooks
   (under full recompute on the checkpoints' outputs). Its options are those megatron-core
   expresses, and its plan is the megatron one: ``apply`` sets those fields in place, and the
   same fields build the model through TransformerConfig.
   (The probe steps and their timelines live in plan_probe.py, the measuring and the ranks'
   agreement in plan_measure.py, the prediction and the search in plan_search.py.)
7. Scope. Any TP, SP, CP, precision; PP with the 1F1B schedule or the interleaved one, each
   stage planned for its own layers (its chunks alike under interleaving). Stages plan alone;
   where one finds no plan, every rank raises its message (:func:`plan_recompute`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import get_rng_snapshot, set_rng_snapshot
from megatron_core.tensor_parallel.recompute.plan_contest import rivals
from megatron_core.tensor_parallel.recompute.plan_contest import timed_choice as _timed_choice
from megatron_core.tensor_parallel.recompute.plan_measure import (
    candidate_options,
    measure_chunks,
    measure_stage,
)
from megatron_core.tensor_parallel.recompute.plan_megatron import MegatronCoreBlock
from megatron_core.tensor_parallel.recompute.plan_probe import _find_blocks
from megatron_core.tensor_parallel.recompute.plan_search import (
    OptionMeasure,
    StageMeasure,
    _megatron_candidates,
    _overhead,
    headroom,
    predict_peak,
    schedule_in_flight,
    search_plan,
    smallest_fit,
)

__all__ = [
    "OptionMeasure",
    "StageMeasure",
    "RecomputePlan",
    "candidate_options",
    "parse_memory_budget",
    "measure_stage",
    "predict_peak",
    "headroom",
    "search_plan",
    "smallest_fit",
    "plan_recompute",
    "measure_chunks",
    "choose_plan",
    "in_flight_microbatches",
    "schedule_in_flight",
]

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


@dataclasses.dataclass
class RecomputePlan:
    """A per-layer recompute plan with its prediction.

    Attributes:
        choices: one option per layer (NOTE [ Recompute planner ], rule 1).
        budget: the budget in bytes, and whether it bounds the total or activations only.
        predicted_peak: predicted peak bytes of a training step on this rank: model states +
            the step's peak (or the step's alone, with ``activations_only``).
        overhead_ms: predicted extra milliseconds per microbatch over no recompute.
        step_ms: the measured milliseconds of a microbatch without recompute.
        megatron: the fastest plan megatron-core's TransformerConfig can express that fits
            (its fields, predicted peak and overhead), or None where none fits.
        stage: the measurements.
        timed: where the plans below differed, each was timed (ms per microbatch: ``plan_ms``
            the per-layer one as searched, ``megatron_ms``, and ``edge_plan_ms`` /
            ``edge_megatron_ms`` for the edges that fit as measured) and the fastest became
            :attr:`choices` (rule 4); else None.
        rivals: other plans that fit and may be faster than the time model says (rule 4:
            megatron-core settings close to the best one and the one that recomputes the
            least FLOP share, the FLOP-share search's plan), each
            a dict like an edge's; they join the timed candidates.
        chosen_by: "model" (the time model alone: nothing else to time), "time" (the fastest
            timed candidate, by its least round), "less recompute" (the fastest recomputes
            all a candidate does and more, and was not 15% faster than it: that one) or
            "flops" (of the timed candidates the rounds could not tell apart from the fastest,
            the least FLOP share of recompute).
        edges: the per-layer plan and the megatron setting that are predicted faster but fit
            only without the 2% margin (rule 4), each a dict with ``source`` ("plan" or
            "megatron"), ``choices``, ``predicted_peak``, ``overhead_ms`` (and ``fields``);
            after :func:`plan_recompute` also ``measured_peak`` (one microbatch's step with it,
            above what was allocated before it, the stage's largest), ``predicted_one`` (that
            step's prediction) and ``fits`` (:func:`fits_when_measured`).
    """

    choices: list[str]
    budget: int
    activations_only: bool
    predicted_peak: int
    overhead_ms: float
    step_ms: float
    megatron: dict | None
    stage: StageMeasure
    timed: dict | None = None
    edges: list[dict] = dataclasses.field(default_factory=list)
    rivals: list[dict] = dataclasses.field(default_factory=list)
    chosen_by: str = "model"

    def apply(self, model: torch.nn.Module) -> None:
        """Set the plan on ``model``'s TransformerBlock (``set_layer_recompute``; on
        megatron-core's block: its config's recompute fields and its layers' flags, as
        :attr:`megatron`'s fields would have built them); on each chunk of a list of them."""
        several = isinstance(model, (list, tuple, torch.nn.ModuleList))
        for chunk in model if several else [model]:
            (block,) = _find_blocks(chunk)
            block.set_layer_recompute(self.choices)

    def _timed_name(self, key: str) -> str:
        """What :attr:`timed`'s ``key`` names, for the printout."""
        names = {"plan_ms": "the per-layer search's plan", "megatron_ms": "megatron-core's",
                 "edge_plan_ms": "the near-budget per-layer plan",
                 "edge_megatron_ms": "the near-budget megatron-core setting"}  # fmt: skip
        if key in names:
            return names[key]
        source, _, index = key[: -len("_ms")].rpartition("_")
        rival = self.rivals[int(index)]
        if source == "flops":
            return f"the FLOP-share search's plan {rival['choices']}"
        fields = ", ".join(f"{k}={v!r}" for k, v in rival["fields"].items())
        return f"megatron-core's {fields}"

    def __str__(self) -> str:
        stage, lines = self.stage, []
        scope = "activations" if self.activations_only else "total"
        lines.append(
            f"recompute plan: budget {self.budget / _MiB:,.1f} MiB ({scope}), predicted peak "
            f"{self.predicted_peak / _MiB:,.1f} MiB, overhead {self.overhead_ms:.2f} ms per "
            f"microbatch over {self.step_ms:.2f} ms without recompute"
        )
        if not self.activations_only:
            lines.append(
                f"  allocated as a step begins {stage.static / _MiB:,.1f} MiB: model states "
                f"{stage.states / _MiB:,.1f} MiB, other {(stage.static - stage.states) / _MiB:,.1f}"
                " MiB (buffers kept from a first step, data)"
            )
        if stage.microbatches > 1:
            lines.append(
                f"  microbatches {stage.microbatches} per step, {stage.in_flight} held at once"
            )
        if stage.chunks > 1:
            lines.append(f"  the plan is each of this rank's {stage.chunks} model chunks'")
        lines.append("  | layer | recompute | kept (MiB) | extra (ms) |")
        lines.append("  |---|---|---|---|")
        for j, choice in enumerate(self.choices):
            option = stage.options[choice]
            lines.append(
                f"  | {j} | {choice} | {option.kept / _MiB:.2f} | {option.extra_ms:.2f} |"
            )
        for edge in self.edges:
            if "measured_peak" in edge:
                verdict = "fits" if edge["fits"] else "does not fit"
                lines.append(
                    f"  near the budget: the {edge['source']} plan {edge['choices']} (predicted "
                    f"peak {edge['predicted_peak'] / _MiB:,.1f} MiB): one microbatch's step "
                    f"measured {edge['measured_peak'] / _MiB:,.2f} MiB against "
                    f"{edge['predicted_one'] / _MiB:,.2f} MiB predicted: {verdict}"
                )
        if self.timed is not None:
            said = ", ".join(f"{self._timed_name(k)} {v:.2f} ms" for k, v in self.timed.items())
            how = {"time": "the fastest is the plan", "flops": "the rounds could not tell the "
                   "fastest from the others within 1%: the least FLOP share of recompute among "
                   "them is the plan", "less recompute": "the fastest recomputes all of a plan "
                   "timed within 15% of it and more: that plan is the plan"}  # fmt: skip
            how = how[self.chosen_by]
            lines.append(f"  timed per microbatch, the least of its rounds: {said} ({how})")
        if self.megatron is None:
            lines.append("  megatron-core TransformerConfig: no single setting fits")
        else:
            fields = ", ".join(f"{k}={v!r}" for k, v in self.megatron["fields"].items())
            lines.append(
                f"  megatron-core TransformerConfig: {fields} (predicted peak "
                f"{self.megatron['predicted_peak'] / _MiB:,.1f} MiB, overhead "
                f"{self.megatron['overhead_ms']:.2f} ms)"
            )
        return "\n".join(lines)


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
        return _timed_choice(plan, chunks, forwards, repeats)
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
