"""NOTE [ Peer deadline ]: a rank that never enters a collective its peers wait in is named on
every waiting rank within the deadline, instead of a silent wait until the group's timeout.

Each body waits in a group of its own whose timeout (60 s) is far above the deadline (2 s), so
only the package's deadline can end the wait, and the stuck collective stays in that group."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from megatron_core import MegatronCoreError, consistency
from megatron_core.testing import run_distributed


def _group():
    return dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(60))


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _skipped_backward(window_open):
    # The held-out case: rank 1 runs a distributed-input checkpoint's forward and never its
    # backward; rank 0's backward gathers the input (after the window: the gather itself waits;
    # inside it: the agreement before the gather waits).
    from megatron_core.tensor_parallel import checkpoint

    group = _group()
    consistency.set_peer_deadline(2.0)
    x = torch.ones(4, 3, requires_grad=True)
    with consistency.check_mode(consistency.CheckMode.WINDOW):
        consistency.set_window(None if window_open else 0)
        try:
            out = checkpoint(torch.sin, True, x, tp_group=group, use_reentrant=False)
            if dist.get_rank() == 1:
                return "ok", "", 0.0
            return _outcome(lambda: out.sum().backward())
        finally:
            consistency.set_window(None)


@pytest.mark.parametrize("window_open", [True, False])
def test_a_rank_that_skips_backward_is_named_within_the_deadline(window_open):
    (kind, message, seconds), skipped = run_distributed(_skipped_backward, 2, window_open)
    assert skipped == ("ok", "", 0.0)
    assert kind == "CollectiveError", message
    assert "within the peer deadline" in message and "MEGATRON_CORE_PEER_DEADLINE" in message
    assert "global rank(s) [1] never entered it (rank(s) [0] did)" in message, message
    assert 1.9 < seconds < 30


def _one_rank_missing():
    from megatron_core.tensor_parallel import _collectives

    group = _group()
    consistency.set_peer_deadline(2.0)
    if dist.get_rank() == 2:
        return "ok", "", 0.0
    with consistency.check_mode(consistency.CheckMode.OFF):
        return _outcome(lambda: _collectives.all_reduce(torch.zeros(2), group))


def test_every_waiting_rank_names_the_missing_one():
    for rank, (kind, message, _) in enumerate(run_distributed(_one_rank_missing, 3)[:2]):
        assert kind == "CollectiveError", (rank, message)
        assert "global rank(s) [2] never entered it (rank(s) [0, 1] did)" in message, message


def test_the_deadline_setting(monkeypatch):
    monkeypatch.delenv(consistency.DEADLINE_ENV, raising=False)
    assert consistency.peer_deadline() == consistency.DEFAULT_DEADLINE_S == 900.0
    monkeypatch.setenv(consistency.DEADLINE_ENV, "off")
    assert consistency.peer_deadline() is None
    monkeypatch.setenv(consistency.DEADLINE_ENV, "12.5")
    assert consistency.peer_deadline() == 12.5
    monkeypatch.setenv(consistency.DEADLINE_ENV, "soon")
    with pytest.raises(MegatronCoreError, match="MEGATRON_CORE_PEER_DEADLINE='soon' must be"):
        consistency.peer_deadline()
    try:
        consistency.set_peer_deadline(3)
        assert consistency.peer_deadline() == 3.0
        consistency.set_peer_deadline(None)
        assert consistency.peer_deadline() is None
        with pytest.raises(MegatronCoreError, match="seconds \\(-1\\) must be a positive"):
            consistency.set_peer_deadline(-1)
    finally:
        consistency.set_peer_deadline("unset")


def _different_deadlines():
    from megatron_core import parallel_state

    consistency.set_peer_deadline(10.0 + dist.get_rank())
    try:
        parallel_state.initialize_model_parallel()
    except MegatronCoreError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_deadlines_are_refused_at_initialization():
    for message in run_distributed(_different_deadlines, 2):
        assert "peer deadline (MEGATRON_CORE_PEER_DEADLINE): rank 0 = 10.0, rank 1 = 11.0" in (
            message
        ), message
