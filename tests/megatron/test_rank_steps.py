"""The step after each test of a torchrun pytest session (NOTE [ Ranks out of step in a test
session ]), on an in-memory store standing in for torchrun's: in step, out of step, different
tests. The whole session through torchrun is in test_megatron_pytest_plugin_suite.py."""

import pytest
import torch.distributed as dist

from megatron_core.megatron import _rank_steps
from megatron_core.megatron._rank_steps import RankSteps


class _Left(Exception):
    pass


@pytest.fixture
def leaving(monkeypatch):
    def _exit(status):
        raise _Left(status)

    monkeypatch.setattr(_rank_steps.os, "_exit", _exit)


def _pair(timeout_s):
    store = dist.HashStore()
    return store, [RankSteps(store, r, 2, "p/", timeout_s) for r in range(2)]


def test_ranks_in_step_go_on(leaving):
    store, (rank0, rank1) = _pair(5.0)
    for test in ("a.py::t1", "a.py::t2"):
        store.set(f"p/{rank1.step}/1", test)  # rank 1 got there first
        rank1.step += 1
        rank0.after_test(test)
    assert rank0.step == 2


def test_a_missing_rank_ends_the_session_naming_it(leaving, capsys):
    _, (rank0, _) = _pair(0.2)
    rank0.failures.append("a.py::t1 (call):\nAssertionError: only here")
    with pytest.raises(_Left, match="1"):
        rank0.after_test("a.py::t1")
    err = capsys.readouterr().err
    assert "rank(s) [1] did not finish test 1 of the session within 0.2 s" in err
    assert "AssertionError: only here" in err


def test_ranks_that_ran_different_tests_stop(leaving, capsys):
    store, (rank0, _) = _pair(5.0)
    store.set("p/0/1", "a.py::other")
    with pytest.raises(_Left):
        rank0.after_test("a.py::t1")
    assert "rank 0: a.py::t1; rank 1: a.py::other" in capsys.readouterr().err


def test_outside_torchrun_nothing_is_done(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert RankSteps.from_environment(5.0) is None


class _Config:
    """A pytest config as the plugin reads it: pytest-timeout's option and ini value."""

    def __init__(self, option, ini, installed=True):
        self.option, self.ini, self.installed = option, ini, installed

    def getoption(self, name):
        if name != "timeout" or not self.installed:
            raise ValueError(name)
        return self.option

    def getini(self, name):
        return self.ini


@pytest.mark.parametrize(
    "config, expected",
    [
        (_Config(90.0, ""), 90.0),  # --timeout 90
        (_Config(None, "300"), 300.0),  # timeout = 300 in the ini file
        (_Config(None, ""), None),  # pytest-timeout unset: the plugin's own default
        (_Config(0.0, ""), None),  # --timeout 0 switches pytest-timeout off
        (_Config(None, "", installed=False), None),  # pytest-timeout not installed
    ],
)
def test_the_step_limit_follows_pytest_timeout(config, expected):
    from megatron_core.megatron import pytest_plugin

    assert pytest_plugin._pytest_timeout(config) == expected
