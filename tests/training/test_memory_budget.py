"""The main job's --memory-budget (megatron_core/training/memory_plan.py): it plans, prints
the plan, trains with it, and its measured peak of a planned iteration matches the prediction
and fits the budget; bad budgets and combinations are refused before any process starts."""

import contextlib
import io
import re

import pytest
from _train_args import argv_of, corpus_file

from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed
from megatron_core.training import parse_args, train, validate_args

BASE = {
    "data": corpus_file(),
    "num-layers": 3,
    "hidden-size": 64,
    "num-attention-heads": 4,
    "seq-length": 64,
    "micro-batch-size": 4,
    "train-iters": 3,
    "log-interval": 1000,
    "tensor-model-parallel-size": 2,
}
_MEMORY = re.compile(
    r"memory \(total\): predicted peak ([\d,.]+) MiB, measured ([\d,.]+) MiB .*budget ([\d,.]+)"
)


def _printed(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(parse_args(argv))
    return out.getvalue()


def _refusal(argv: list[str]) -> str:
    try:
        train(parse_args(argv))
    except MegatronCoreError as error:
        return str(error)
    return "no error"


def _numbers(text: str) -> tuple[float, float, float]:
    match = _MEMORY.search(text)
    assert match, text
    return tuple(float(x.replace(",", "")) for x in match.groups())


def test_memory_budget_plans_trains_and_measures_within_the_budget():
    generous = run_distributed(_printed, 2, argv_of(BASE, memory_budget="1GiB"), timeout=300)[0]
    assert "| 2 | none |" in generous  # everything fits: nothing recomputed
    predicted, measured, _ = _numbers(generous)
    # both the allocator's total at the peak, nothing subtracted (the planner's test bound,
    # test_plan.py: 5%)
    assert abs(predicted - measured) <= 0.05 * measured, generous
    # The smallest budget that fits, from the planner's own refusal of a budget far too small.
    refused = run_distributed(_refusal, 2, argv_of(BASE, memory_budget="1MiB"), timeout=300)[0]
    smallest = int(re.search(r"the smallest that fits is ([\d,]+) bytes", refused).group(1)
                   .replace(",", ""))  # fmt: skip
    budget = (smallest + predicted * 2**20) / 2  # between it and what no recompute needs
    tight = run_distributed(
        _printed, 2, argv_of(BASE, memory_budget=str(int(budget))), timeout=300
    )[0]
    plan = re.findall(r"\| \d \| (\S+) \|", tight)
    assert len(plan) == 3 and plan != ["none"] * 3, tight
    predicted, measured, printed_budget = _numbers(tight)
    assert measured <= printed_budget, tight
    assert abs(predicted - measured) <= 0.05 * measured, tight
    assert "done: iterations 1-3" in tight


@pytest.mark.parametrize("per_chunk, held", [(None, 2), (2, 5)])
def test_memory_budget_plans_each_pipeline_stage(per_chunk, held):
    # PP 2, four microbatches: stage 0 holds two of them at once under 1F1B; under the
    # interleaved schedule (two chunks of two layers) its 2 + 2 warm-up forwards and one more
    # (rank 0 prints its plan and its measured peak: the whole step of the schedule)
    argv = argv_of(BASE, memory_budget="1GiB", pipeline_model_parallel_size=2,
                   tensor_model_parallel_size=1, num_layers=4 if per_chunk is None else 8,
                   num_layers_per_virtual_pipeline_stage=per_chunk,
                   global_batch_size=16)  # fmt: skip
    text = run_distributed(_printed, 2, argv, timeout=300)[0]
    assert "| 1 | none |" in text and "| 2 | none |" not in text, text  # its own two layers
    assert f"microbatches 4 per step, {held} held at once" in text, text
    assert ("the plan is each of this rank's 2 model chunks'" in text) == bool(per_chunk), text
    predicted, measured, budget = _numbers(text)
    assert measured <= budget, text
    assert abs(predicted - measured) <= 0.05 * measured, text


def test_a_stage_that_cannot_fit_stops_every_stage_with_its_error():
    # Each pipeline stage plans alone; where one finds no plan, every rank raises its message
    # (the others name the rank) before training, so no stage waits on a peer that stopped.
    argv = argv_of(BASE, memory_budget="1MiB", pipeline_model_parallel_size=2,
                   tensor_model_parallel_size=1, num_layers=4, global_batch_size=16)  # fmt: skip
    first, second = run_distributed(_refusal, 2, argv, timeout=300)
    assert re.search(r"no plan fits the budget of 1,048,576 bytes", first), first
    assert second == first + " (rank 0)", (first, second)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"memory_budget": "lots"}, r"memory budget 'lots' is not a size"),
        ({"memory_budget": "1GiB", "recompute_granularity": "full"},
         r"--memory-budget \(1GiB\) chooses the recompute itself: drop --recompute-granularity"),
        ({"memory_budget": "1GiB", "pipeline_model_parallel_size": 2,
          "tensor_model_parallel_size": 1, "num_layers": 4,
          "num_layers_per_virtual_pipeline_stage": 1},
         r"--num-layers-per-virtual-pipeline-stage \(1\): the planner .* needs at least 2 per "
         r"chunk"),
    ],
)  # fmt: skip
def test_bad_memory_budgets_are_refused_before_training(options, message):
    with pytest.raises(MegatronCoreError, match=message):
        validate_args(parse_args(argv_of(BASE, **options)), 2)
