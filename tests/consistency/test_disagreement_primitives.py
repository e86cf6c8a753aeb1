"""The machinery of megatron_core.consistency: the switch, agree, agreed_errors, error naming.

The per-rank bodies catch what they raise and return (exception type, message, seconds), so one
warm worker pool serves every case; tests then check that every rank raised the same message.
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_core import consistency
from megatron_core.consistency import CheckMode, CollectiveError, RankDisagreementError
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import DistributedTestError, run_distributed

# --- the switch (no processes) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "env, debug, override, expected",
    [
        (None, None, None, False),
        ("1", None, None, True),
        ("on", None, None, True),
        ("0", "DETAIL", None, False),  # an explicit 0 wins over torch's DETAIL
        (None, "DETAIL", None, True),
        (None, "INFO", None, False),
        ("1", None, False, False),  # the function wins over the environment
        (None, None, True, True),
    ],
)
def test_switch(monkeypatch, env, debug, override, expected):
    for name, value in ((consistency.CHECK_ENV, env), ("TORCH_DISTRIBUTED_DEBUG", debug)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    new = None if override is None else ("always" if override else "off")
    previous = consistency.set_mode(new)
    try:
        assert (consistency.mode() is CheckMode.ALWAYS) is expected
    finally:
        consistency.set_mode(previous)


@pytest.mark.parametrize(
    "env, debug, expected",
    [
        (None, None, "window"),  # the default
        ("window", None, "window"),
        ("1", None, "always"),
        ("always", None, "always"),
        ("0", None, "off"),
        ("off", "DETAIL", "off"),
        (None, "DETAIL", "always"),
    ],
)
def test_mode_from_the_environment(monkeypatch, env, debug, expected):
    for name, value in ((consistency.CHECK_ENV, env), ("TORCH_DISTRIBUTED_DEBUG", debug)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    previous = consistency.set_mode(None)  # read the environment again
    try:
        assert consistency.mode() is consistency.CheckMode(expected)
    finally:
        consistency.set_mode(previous)


def test_bad_mode_and_window_values_are_named(monkeypatch):
    monkeypatch.setenv(consistency.CHECK_ENV, "sometimes")
    previous = consistency.set_mode(None)
    try:
        with pytest.raises(MegatronCoreError, match="MEGATRON_CORE_CHECK_CONSISTENCY='sometimes'"):
            consistency.mode()
    finally:
        monkeypatch.delenv(consistency.CHECK_ENV)
        consistency.set_mode(previous)
    with pytest.raises(MegatronCoreError, match=r"set_mode: mode \('never'\) must be"):
        consistency.set_mode("never")
    with pytest.raises(MegatronCoreError, match=r"set_window: size \(-1\) must be an int >= 0"):
        consistency.set_window(-1)
    monkeypatch.setenv(consistency.WINDOW_ENV, "lots")
    consistency.set_window(None)
    with pytest.raises(MegatronCoreError, match="MEGATRON_CORE_CHECK_WINDOW='lots'"):
        consistency.window_size()
    monkeypatch.delenv(consistency.WINDOW_ENV)
    consistency.set_window(None)
    assert consistency.window_size() == consistency.DEFAULT_WINDOW


def test_check_mode_context_restores(monkeypatch):
    monkeypatch.delenv(consistency.CHECK_ENV, raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    with consistency.check_mode():
        assert consistency.mode() is CheckMode.ALWAYS
        with consistency.check_mode(False):
            assert consistency.mode() is CheckMode.OFF
        assert consistency.mode() is CheckMode.ALWAYS
    assert consistency.mode() is CheckMode.WINDOW
    consistency.set_mode("always")
    assert consistency.mode() is CheckMode.ALWAYS
    consistency.set_mode(CheckMode.OFF)
    assert consistency.mode() is CheckMode.OFF
    consistency.set_mode(None)
    with pytest.raises(MegatronCoreError, match=r"set_mode: mode \('yes'\) must be a CheckMode"):
        consistency.set_mode("yes")


# --- multi-rank bodies ------------------------------------------------------------------------


def _outcome(fn, *args, **kwargs):
    start = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", value, time.monotonic() - start


def _group(seconds=30.0):
    timeout = datetime.timedelta(seconds=seconds)
    return dist.new_group(list(range(dist.get_world_size())), timeout=timeout)


def _body_agree(kind):
    rank, group = dist.get_rank(), _group()
    x = torch.zeros(4, 3)
    if kind == "same":
        return _outcome(consistency.agree, "op", group, x, vocab=8, keys=["a", "b"])
    if kind == "shape":
        return _outcome(consistency.agree, "gather", group, torch.zeros(4, 3 + 2 * (rank == 1)))
    if kind == "dtype":
        return _outcome(consistency.agree, "gather", group, x.double() if rank else x)
    if kind == "args":
        return _outcome(consistency.agree, "ce", group, x, vocab_partition=4 + 2 * rank)
    if kind == "op":
        return _outcome(consistency.agree, "all_reduce" if rank else "broadcast", group, x)
    if kind == "many_dims":  # the 9th dimension differs: hashed, still caught
        shape = (1,) * 8 + (2 + rank,)
        return _outcome(consistency.agree, "op", group, torch.zeros(shape))
    raise AssertionError(kind)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_agree_passes_when_ranks_agree(world_size):
    for kind, value, _ in run_distributed(_body_agree, world_size, "same", timeout=60):
        assert (kind, value) == ("ok", None)


R0, R1 = "rank 0 (global rank 0) =", "rank 1 (global rank 1) ="


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("shape", f"disagree on shape: {R0} (4, 3), {R1} (4, 5)"),
        ("dtype", f"disagree on dtype: {R0} torch.float32, {R1} torch.float64"),
        ("args", f"disagree on vocab_partition: {R0} 4, {R1} 6"),
        ("op", f"disagree on op: {R0} broadcast, {R1} all_reduce"),
        ("many_dims", f"disagree on shape: {R0} (1, 1, 1, 1, 1, 1, 1, 1, 2), {R1} (1, 1, 1"),
    ],
)
def test_agree_raises_the_same_error_on_every_rank(world_size, kind, expected):
    results = run_distributed(_body_agree, world_size, kind, timeout=60)
    messages = {message for _, message, _ in results}
    assert len(messages) == 1, messages  # the very same text on every rank
    for kind_name, message, seconds in results:
        assert kind_name == "RankDisagreementError"
        assert "the process group of global ranks" in message
        assert seconds < 10
        assert expected in message, message


def _body_agreed_errors(bad_rank):
    group = _group()

    def body():
        with consistency.agreed_errors("local check", group):
            if dist.get_rank() == bad_rank:
                raise MegatronCoreError(f"value ({dist.get_rank() + 40}) is out of range")
        dist.all_reduce(torch.ones(1), group=group)  # the collective the check protects
        return "passed"

    return _outcome(body)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_agreed_errors(world_size):
    bad = world_size - 1
    results = run_distributed(_body_agreed_errors, world_size, bad, timeout=60)
    messages = {message for _, message, _ in results}
    assert len(messages) == 1, messages
    kind, message, _ = results[0]
    if world_size == 1:  # nothing to agree with: the local error itself
        assert (kind, message) == ("MegatronCoreError", "value (40) is out of range")
        return
    assert kind == "RankDisagreementError"
    assert message.startswith(f"local check failed on 1 of the {world_size} ranks")
    culprit = f"rank {bad} (global rank {bad}): MegatronCoreError: value ({bad + 40}) is out"
    assert culprit in message
    ok = run_distributed(_body_agreed_errors, world_size, -1, timeout=60)
    assert [r[:2] for r in ok] == [("ok", "passed")] * world_size


def _body_check_collective(enabled):
    group = _group()
    x = torch.zeros(2 + dist.get_rank())
    with consistency.check_mode(enabled):
        return _outcome(consistency.check_collective, "all_reduce", group, x)


def test_check_collective_only_in_check_mode():
    off = run_distributed(_body_check_collective, 2, False, timeout=60)
    assert [r[:2] for r in off] == [("ok", None)] * 2  # no exchange: ranks never compared
    on = run_distributed(_body_check_collective, 2, True, timeout=60)
    assert {r[0] for r in on} == {"RankDisagreementError"}
    assert "(2,), rank 1 (global rank 1) = (3,)" in on[0][1]


def _body_window(size: int, bad_at: int):
    """``size + 2`` checks on one group in WINDOW mode; the last rank's tensor differs at call
    ``bad_at`` (1-based). Returns the count after each call, or the error and where."""
    group = _group()
    counts = []
    with consistency.check_mode(consistency.CheckMode.WINDOW):
        consistency.set_window(size)
        try:
            for call in range(1, size + 3):
                rows = 3 if call == bad_at and dist.get_rank() == dist.get_world_size() - 1 else 2
                try:
                    consistency.check_collective("all_reduce", group, torch.zeros(rows))
                except RankDisagreementError as exc:
                    return call, str(exc)
                counts.append(consistency.checked_count(group))
        finally:
            consistency.set_window(None)
    return counts


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_window_agrees_the_first_n_collectives_then_stops_on_every_rank(world_size):
    size = 4
    ok = run_distributed(_body_window, world_size, size, 0, timeout=60)
    assert ok == [[1, 2, 3, 4, 4, 4]] * world_size  # closed at the same count everywhere
    for results in (run_distributed(_body_window, world_size, size, size, timeout=60),):
        assert {call for call, _ in results} == {size}  # the last call inside is still agreed
        assert len({message for _, message in results}) == 1
        assert "(2,)" in results[0][1] and "(3,)" in results[0][1]
    # After the window nothing is exchanged: the differing call passes unseen (mode OFF would
    # be the same), and no rank waits for another.
    after = run_distributed(_body_window, world_size, size, size + 1, timeout=60)
    assert after == [[1, 2, 3, 4, 4, 4]] * world_size


def _body_rare_group_closes():
    busy = dist.new_group([0, 1])  # ranks 2 and 3 (at world size 4) make no checks there
    rare = _group()
    with consistency.check_mode(consistency.CheckMode.WINDOW):
        consistency.set_window(4)
        try:
            for _ in range(4 if dist.get_rank() < 2 else 0):  # an iteration's worth: done
                consistency.check_collective("all_reduce", busy, torch.zeros(2))
            done = consistency.windows_done()
            consistency.check_collective("grad norm", rare, torch.zeros(1))  # carries "done"
            return done, consistency.checked_count(rare), consistency.should_check(rare)
        finally:
            consistency.set_window(None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_group_with_rare_collectives_closes_once_an_iterations_worth_is_checked(world_size):
    # NOTE [ Check window ], rule 4: the rare group's first check is still agreed (its count:
    # 1), then it is closed on every member at once, not after 4 of its own checks, also on the
    # members that made no checks elsewhere (ranks 2, 3).
    results = run_distributed(_body_rare_group_closes, world_size, timeout=60)
    assert results == [(True, 1, False)] * 2 + [(False, 1, False)] * (world_size - 2)


def _body_silent_peer():
    group = _group(seconds=2.0)  # a short group timeout: the peer never comes
    if dist.get_rank() == 1:
        return "ok", None, 0.0
    return _outcome(consistency.agree, "op", group, torch.zeros(1))


def test_silent_peer_times_out_with_a_named_error():
    (kind, message, seconds), _ = run_distributed(_body_silent_peer, 2, timeout=60)
    assert kind == "CollectiveError"
    assert message.startswith(
        "the consistency check's all-gather before op on the process group of global ranks "
        "[0, 1] failed "
        "(a peer did not enter the collective within the group timeout)"
    )
    assert 1.5 < seconds < 10


def _body_silent_peer_after_the_window():
    from megatron_core.tensor_parallel import _collectives

    group = _group(seconds=2.0)
    if dist.get_rank() == 1:
        return "ok", None, 0.0
    with consistency.check_mode(consistency.CheckMode.WINDOW):
        consistency.set_window(0)  # closed: the all-reduce itself is what waits
        try:
            return _outcome(_collectives.all_reduce, torch.zeros(1), group)
        finally:
            consistency.set_window(None)


def test_silent_peer_after_the_window_times_out_with_a_named_error():
    (kind, message, seconds), _ = run_distributed(_body_silent_peer_after_the_window, 2, timeout=60)
    assert kind == "CollectiveError"
    assert message.startswith(
        "all_reduce on the process group of global ranks [0, 1] failed (a peer did not enter "
        "the collective within the group timeout)"
    ), message
    assert 1.5 < seconds < 10


def _body_dead_peer():
    group = _group(seconds=20.0)
    dist.barrier(group=group)
    if dist.get_rank() == 1:
        time.sleep(0.2)
        os._exit(3)  # the peer dies while rank 0 waits in the exchange
    consistency.agree("op", group, torch.zeros(1))


def test_dead_peer_gives_a_named_error():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_body_dead_peer, 2, timeout=60)
    failures = info.value.failures
    assert failures[1].type_name == "WorkerDied"
    assert isinstance(failures[0].exception, CollectiveError), failures[0]
    assert "a peer process of the group died" in failures[0].message
    assert "global ranks [0, 1]" in failures[0].message


def test_errors_are_package_errors():
    assert issubclass(RankDisagreementError, MegatronCoreError)
    assert issubclass(CollectiveError, MegatronCoreError)


def _is_enabled():
    return consistency.mode() is CheckMode.ALWAYS


def test_workers_follow_the_suite_setting():
    # tests/conftest.py turns check mode on for the whole suite unless the variable says otherwise.
    expected = os.environ.get(consistency.CHECK_ENV, "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )
    assert run_distributed(_is_enabled, 2, timeout=60) == [expected, expected]
