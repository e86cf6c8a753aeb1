"""megatron-core 0.19's HyperCommGrid views, destroy and is_current_rank_in_grid.

Rank enumerations are pure logic (worked examples written out by hand, NOTE [ Hyper grid ranks ],
rule 5); the groups are created and destroyed on real gloo ranks.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_core.errors import ConfigError
from megatron_core.hyper_comm_grid import GridKeyError, HyperCommGrid
from megatron_core.testing import run_distributed


@pytest.fixture
def grid(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    return HyperCommGrid([2, 2, 2], ["tp", "pp", "dp"])


def test_view_enumerations(grid):
    """A view over the same 8 ranks: tp shared (the base grid's tp groups), 'edp' its own."""
    grid.register_view("expert", [2, 4], ["tp", "edp"], shared_dims=["tp"])
    assert grid.get_rank_enum("tp", view="expert") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.get_rank_enum("edp", view="expert") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.get_rank_enum(["edp", "tp"], view="expert") == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert grid.get_rank_enum("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # base unchanged


@pytest.mark.parametrize(
    "args, needle",
    [
        (("expert", [2, 4], ["tp", "edp"]), "already registered"),
        (("v", [2, 2], ["a", "b"]), "has 4 ranks, the grid 8"),
        (("v", [2, 4], ["a", "a"]), "distinct names"),
        (("v", [8], ["x"], ["tp"]), "shared_dims"),
        (("v", [4, 2], ["x", "tp"], ["tp"]), "group the ranks differently"),
    ],
)
def test_register_view_refuses(grid, args, needle):
    grid.register_view("expert", [2, 4], ["tp", "edp"], shared_dims=["tp"])
    with pytest.raises(ConfigError, match=needle):  # a ValueError, as megatron-core raises
        grid.register_view(*args)
    with pytest.raises(GridKeyError, match="'nope' is not registered"):
        grid.get_rank_enum("tp", view="nope")


def _views_body():
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    grid.register_view("flat", [4], ["all"])
    grid.register_view("same", [2, 2], ["tp", "x"], shared_dims=["tp"])
    tp = grid.create_pg("tp")
    shared = grid.get_pg("tp", view="same")  # a shared dim is the base grid's group
    everyone = grid.create_pg("all", view="flat")
    with pytest.raises(GridKeyError, match="has already been created"):
        grid.create_pg("tp", view="same")
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=everyone)
    seen = (shared is tp, dist.get_process_group_ranks(everyone), x.item())
    seen += (grid.is_current_rank_in_grid(),)
    grid.destroy()
    with pytest.raises(GridKeyError, match="hasn't been created"):
        grid.get_pg("tp")
    offset = HyperCommGrid([2], ["tp"], rank_offset=2)
    return seen + (offset.is_current_rank_in_grid(),)


def test_views_create_and_destroy_groups():
    results = run_distributed(_views_body, 4)
    for rank, seen in enumerate(results):
        assert seen == (True, [0, 1, 2, 3], 6.0, True, rank >= 2)
