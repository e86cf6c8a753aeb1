"""NOTE [ Check window ], rules 1-3: the default window agrees the first training iterations
whole (as the schedules and finalize_model_grads mark them), closes on every rank alike when
the next one begins, and reopens for a group first used later and for the first evaluation.

One body runs a scripted sequence of iterations through the real schedule
(``forward_backward_no_pipelining`` with ``finalize_model_grads``); its forward step makes one
consistency check on the tensor-parallel group (the last rank's shape differs where a case says
so), and a collective after the schedule stands for the optimizer's. The body returns the check
counts per iteration, or where a disagreement was caught and its message.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_core import ModelParallelConfig, consistency
from megatron_core import parallel_state as ps
from megatron_core.consistency import RankDisagreementError
from megatron_core.distributed import finalize_model_grads
from megatron_core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron_core.testing import run_distributed


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = ModelParallelConfig(
            tensor_model_parallel_size=dist.get_world_size(),
            finalize_model_grads_func=finalize_model_grads,
        )
        self.weight = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return (self.weight * x).sum()


_SECOND = {  # the last rank's second probe, where a script's "bad_mid" says so
    "shape": lambda bad: ((torch.zeros(3 if bad else 2),), {}),
    "dtype": lambda bad: ((torch.zeros(2, dtype=torch.float64 if bad else torch.float32),), {}),
    "args": lambda bad: ((torch.zeros(2),), {"keys": ["a"] if bad else ["a", "b"]}),
    "content": lambda bad: ((torch.zeros(2),), {"content": torch.tensor([1, 3 if bad else 2])}),
}


def _run(script: dict):
    """``script``: iterations (count), bad (iterations where the last rank's first probe
    differs), bad_mid (where its second probe differs, in the way ``kind`` says: _SECOND), eval
    (iterations run forward_only), late (the iteration where a new group is first used), plain
    (iterations run without the schedule: finalize_model_grads, then an optimizer step), sgd
    (iterations run with an optimizer step only). Returns per iteration (iterations seen,
    checks agreed on the TP group, on the late group), or ("caught", iteration, message,
    optimizer steps made)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    tp = ps.get_tensor_model_parallel_group()
    last = dist.get_rank() == dist.get_world_size() - 1
    model, late_group, record = _Tiny(), None, []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    second = _SECOND[script.get("kind", "shape")]
    with consistency.check_mode(consistency.CheckMode.WINDOW):
        for it in range(1, script["iterations"] + 1):
            rows = 3 if last and it in script.get("bad", ()) else 2
            args, kwargs = second(last and it in script.get("bad_mid", ()))

            def forward_step(data_iterator, model, rows=rows, args=args, kwargs=kwargs):
                consistency.check_collective("probe", tp, torch.zeros(rows))
                consistency.check_collective("second probe", tp, *args, **kwargs)
                loss = model(torch.ones(2))
                return loss, lambda output: (output, {"loss": output.detach()})

            try:
                if it == script.get("late"):
                    late_group = dist.new_group(list(range(dist.get_world_size())))
                if it in script.get("plain", ()) or it in script.get("sgd", ()):
                    forward_step(None, model)[0].backward()
                    if it in script.get("plain", ()):
                        finalize_model_grads([model])
                    optimizer.step()
                else:
                    forward_backward_no_pipelining(
                        forward_step_func=forward_step,
                        data_iterator=iter([None]),
                        model=model,
                        num_microbatches=1,
                        forward_only=it in script.get("eval", ()),
                    )
                    optimizer.step()  # after the schedule: a weaker mark, not counted
                consistency.check_collective("after step", tp, torch.zeros(1))
                if late_group is not None:
                    for _ in range(2):
                        consistency.check_collective("late", late_group, torch.zeros(rows))
            except RankDisagreementError as exc:
                return "caught", it, str(exc), len(steps)
            late = consistency.checked_count(late_group) if late_group is not None else None
            record.append((consistency.iterations_seen(), consistency.checked_count(tp), late))
    return record


def _same_everywhere(results):
    assert all(r == results[0] for r in results), results
    return results[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_iterations_are_agreed_whole_then_the_window_closes_on_every_rank(world_size):
    record = _same_everywhere(run_distributed(_run, world_size, {"iterations": 5}, timeout=120))
    marks = [seen for seen, _, _ in record]
    assert marks == [(i, i) for i in range(1, 6)]
    counts = [count for _, count, _ in record]
    # iterations 1 and 2: both probes and the check after the step, every time; iteration 3's
    # first check carries "done" (rule 2) and closes the group on every member after it; from
    # iteration 4 on, only the head (rule 6: the first probe) is agreed
    assert counts == [3, 6, 7, 8, 9]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bad", [1, 2])
def test_a_disagreement_in_iteration_1_or_2_is_caught_on_every_rank(world_size, bad):
    results = run_distributed(_run, world_size, {"iterations": 3, "bad": {bad}}, timeout=120)
    kind, where, message, steps = _same_everywhere(results)
    assert (kind, where, steps) == ("caught", bad, bad - 1)
    assert "probe" in message and "(2,)" in message and "(3,)" in message


def test_after_the_window_the_first_collective_of_an_iteration_is_agreed():
    """Rule 6: iteration 4's first probe, where a batch cut differently shows first, is agreed
    before it runs, as in the window."""
    results = run_distributed(_run, 2, {"iterations": 5, "bad": {4}}, timeout=120)
    kind, where, message, steps = _same_everywhere(results)
    assert (kind, where, steps) == ("caught", 4, 3)
    assert message.startswith("consistency check failed before probe on the "), message


@pytest.mark.parametrize("kind", sorted(_SECOND))
def test_after_the_window_the_digest_catches_a_later_collective_before_the_step(kind):
    """Rule 5: iteration 5's second probe is not agreed; the digest compared when the schedule
    returns names it on every rank, before iteration 5's optimizer step (4 steps made), with
    what it was in iteration 4."""
    script = {"iterations": 6, "bad_mid": {5}, "kind": kind}
    kind_, where, message, steps = _same_everywhere(run_distributed(_run, 2, script, timeout=120))
    assert (kind_, where, steps) == ("caught", 5, 4)
    expected = {
        "shape": "shape: rank 0 (global rank 0) = (2,), rank 1 (global rank 1) = (3,)",
        "dtype": "dtype: rank 0 (global rank 0) = torch.float32, rank 1 (global rank 1) = "
        "torch.float64",
        "args": "keys: rank 0 (global rank 0) = ['a', 'b'], rank 1 (global rank 1) = ['a']",
        "content": "content checksum: rank 0 (global rank 0) = 3.0/5.0, rank 1 (global rank 1) "
        "= 4.0/7.0",
    }[kind]
    assert message == (
        "the iteration digest of the tensor-model-parallel / model-parallel group (global ranks "
        "[0, 1]) at the end of iteration 5 found that the ranks ran different collectives "
        "since the last digest (every rank raises this error): collective #3 (second probe) of "
        f"the 3 each rank ran differs: {expected}; in the iteration before, collective #3 was "
        "op second probe, shape (2,), dtype torch.float32"
        + {"args": ", keys ['a', 'b']", "content": ", content checksum 3.0/5.0"}.get(kind, "")
        + " on every rank"
    )


def test_a_group_first_used_after_the_window_gets_its_iteration():
    results = run_distributed(_run, 2, {"iterations": 6, "late": 4}, timeout=120)
    record = _same_everywhere(results)
    # iteration 4: both checks on the new group agreed; iteration 5: its first check carries
    # "done", then it is closed; iteration 6: its head
    assert [late for _, _, late in record] == [None, None, None, 2, 3, 4]
    caught = run_distributed(_run, 2, {"iterations": 5, "late": 4, "bad": {4}}, timeout=120)
    assert _same_everywhere(caught)[:2] == ("caught", 4)


def test_the_first_evaluation_after_the_window_is_agreed():
    script = {"iterations": 6, "eval": {4, 5}}
    record = _same_everywhere(run_distributed(_run, 2, script, timeout=120))
    assert [seen for seen, _, _ in record][3:] == [(4, 3), (5, 3), (6, 4)]
    # iteration 4 (the first evaluation) reopens: three checks; iteration 5's first check
    # closes the group again; iteration 6: the head
    assert [count for _, count, _ in record] == [3, 6, 7, 10, 11, 12]
    caught = run_distributed(_run, 2, {"iterations": 5, "eval": {4}, "bad": {4}}, timeout=120)
    assert _same_everywhere(caught)[:2] == ("caught", 4)


@pytest.mark.parametrize("loop", ["plain", "sgd"])
def test_a_loop_without_the_schedules_is_marked_by_finalize_or_its_optimizer(loop):
    """plain: finalize_model_grads marks each iteration after its forward; sgd: the optimizer's
    pre-step hook. Iteration 3's probes are still agreed, its check after the step carries
    "done"; the mark ends an iteration, so from iteration 4 the head is the check after the
    step. The digest is compared at the mark, before the step."""
    script = {"iterations": 5, loop: {1, 2, 3, 4, 5}}
    record = _same_everywhere(run_distributed(_run, 2, script, timeout=120))
    assert [seen for seen, _, _ in record] == [(i, i) for i in range(1, 6)]
    assert [count for _, count, _ in record] == [3, 6, 9, 10, 11]
    script = {"iterations": 6, loop: {1, 2, 3, 4, 5, 6}, "bad_mid": {5}}
    kind, where, message, steps = _same_everywhere(run_distributed(_run, 2, script, timeout=120))
    assert (kind, where, steps) == ("caught", 5, 4)
    place = "at finalize_model_grads" if loop == "plain" else "before the optimizer step"
    assert f"{place} of iteration 5 found" in message and "#3 (second probe)" in message


def test_the_schedule_is_the_only_mark_once_seen():
    """An optimizer step alone, then the schedule: the schedule's first mark starts the count
    again (rule 1), and the optimizer steps after it count nothing."""
    mixed = {"iterations": 5, "sgd": {1}}
    record = _same_everywhere(run_distributed(_run, 2, mixed, timeout=120))
    assert [seen for seen, _, _ in record] == [(1, 1), (1, 1), (2, 2), (3, 3), (4, 4)]
    # the count restarted at iteration 2: iterations 2-3 agreed whole, 4's first check closes
    assert [count for _, count, _ in record] == [3, 6, 9, 10, 11]


def _set_iterations(count):
    consistency.set_window_iterations(count)
    try:
        return _run({"iterations": 3})
    finally:
        consistency.set_window_iterations(None)


def test_the_iteration_count_is_configurable():
    record = _same_everywhere(run_distributed(_set_iterations, 2, 1, timeout=120))
    assert [count for _, count, _ in record] == [3, 4, 5]
    with pytest.raises(Exception, match="iterations"):
        consistency.set_window_iterations(-1)


# --- NOTE [ Host-side agreement ]: the gloo shadow of a device-only group ----------------------


def _through_shadows():
    from megatron_core.parallel_state import agreement, groups

    agreement._SHADOW_GLOO_GROUPS = True  # shadow gloo groups too: the NCCL path on this CPU
    try:
        # every rank creates every pair, as parallel_state does; each gets its shadow
        pairs = [groups.create_group([low, low + 1]) for low in range(0, dist.get_world_size(), 2)]
        pair = pairs[dist.get_rank() // 2]
        shadow = agreement.host_group(pair)
        with consistency.check_mode(consistency.CheckMode.ALWAYS):
            consistency.check_collective("fine", pair, torch.zeros(2))
            rows = 3 if dist.get_rank() % 2 else 2
            try:
                consistency.check_collective("probe", pair, torch.zeros(rows))
                caught = None
            except RankDisagreementError as exc:
                caught = str(exc)
        return (
            shadow is not pair,
            dist.get_backend(shadow),
            dist.get_process_group_ranks(shadow),
            caught,
        )
    finally:
        agreement._SHADOW_GLOO_GROUPS = False
        agreement._SHADOWS.clear()


@pytest.mark.parametrize("world_size", [2, 4])
def test_agreements_of_a_device_group_run_on_its_gloo_shadow(world_size):
    results = run_distributed(_through_shadows, world_size, timeout=120)
    for rank, (own_shadow, backend, shadow_ranks, caught) in enumerate(results):
        low = rank - rank % 2
        assert own_shadow and backend == "gloo" and shadow_ranks == [low, low + 1]
        # the disagreement is still caught, named on the group itself
        assert "probe" in caught and "(2,)" in caught and "(3,)" in caught
        assert f"global ranks [{low}, {low + 1}]" in caught
