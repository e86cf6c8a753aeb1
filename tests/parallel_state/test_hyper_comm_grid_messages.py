"""HyperCommGrid's errors carry the texts megatron-core's own unit tests match
(tests/unit_tests/test_hyper_comm_grid.py of Megatron-LM core_v0.16.1), with the exception types
those tests expect, and still name the offending values."""

import pytest
import torch.distributed as dist

from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.testing import run_distributed


def test_shape_and_names_mismatch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"len\(shape\).*!= len\(dim_names\)") as raised:
        HyperCommGrid([2, 2], ["tp"])
    assert "[2, 2]" in str(raised.value) and "['tp']" in str(raised.value)


def test_grid_larger_than_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(RuntimeError, match="Grid shape.*is over sized") as raised:
        HyperCommGrid([4, 4], ["tp", "dp"])
    assert "[4, 4]" in str(raised.value) and "world size 8" in str(raised.value)


def test_get_before_create(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid([2, 4], ["tp", "dp"])
    with pytest.raises(KeyError, match="Process group for.*hasn't been created") as raised:
        grid.get_pg("tp")
    assert "'tp'" in str(raised.value)


def _create_twice() -> str:
    grid = HyperCommGrid([2], ["tp"])
    grid.create_pg("tp")
    # A gloo group's pairs may still be connecting on the peer when this rank has its side; the
    # barrier keeps destroy() below from closing a socket the peer still handshakes on.
    dist.barrier()
    try:
        grid.create_pg("tp")
    except KeyError as error:
        return str(error)
    finally:
        grid.destroy()
    return "no error"


def test_create_twice():
    for message in run_distributed(_create_twice, 2):
        assert "Process group 'tp' has already been created" in message
