"""The plan the recompute planner returns (:class:`RecomputePlan`): per-layer choices, the
prediction behind them, megatron-core's best setting beside them, what was timed, and how the
plan was chosen (NOTE [ Recompute planner ] in the planner's face)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_core.tensor_parallel.recompute.planner.probe import _find_blocks
from megatron_core.tensor_parallel.recompute.planner.search import StageMeasure

__all__ = ["RecomputePlan"]

_MiB = 1 << 20


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
            every other megatron-core setting that fits, save one recomputing all another
            does and more; the FLOP-share search's plan; the search's plan with a selective
            option it uses costing twice as much), each a dict like an edge's; they join the
            timed candidates.
        chosen_by: "model" (the time model alone: nothing else to time), "time" (the fastest timed
            candidate, by its rounds paired with the others'), "less recompute" (the fastest
            recomputes all a candidate does and more, and was not 15% faster than it: that one) or
            "flops" (of the timed candidates the rounds could not tell apart from the fastest
            within 1%, after more rounds for those they could not yet place, the least FLOP
            share of recompute).
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
        if source == "costlier":
            return f"the search's plan with {rival['option']} costing more {rival['choices']}"
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
            lines.append(f"  timed per microbatch, by rounds paired: {said} ({how})")
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
