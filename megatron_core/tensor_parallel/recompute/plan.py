"""The recompute planner's public names at the path they were first served from
(``from megatron_core.tensor_parallel.recompute.plan import plan_recompute``): the same objects
as :mod:`megatron_core.tensor_parallel.recompute.planner`, where the planner lives (NOTE
[ Recompute planner ] in its face)."""

from megatron_core.tensor_parallel.recompute.planner import (
    OptionMeasure,
    RecomputePlan,
    StageMeasure,
    candidate_options,
    choose_plan,
    headroom,
    in_flight_microbatches,
    measure_chunks,
    measure_stage,
    parse_memory_budget,
    plan_recompute,
    predict_peak,
    schedule_in_flight,
    search_plan,
    smallest_fit,
)

__all__ = [
    "plan_recompute",
    "choose_plan",
    "parse_memory_budget",
    "in_flight_microbatches",
    "RecomputePlan",
    "candidate_options",
    "measure_stage",
    "measure_chunks",
    "OptionMeasure",
    "StageMeasure",
    "predict_peak",
    "headroom",
    "search_plan",
    "smallest_fit",
    "schedule_in_flight",
]
