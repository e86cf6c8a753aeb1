"""megatron-core 0.16.1 names outside tensor_parallel: enums, HyperCommGrid,
ProcessGroupHelperMeta, reset_model_temporary_tensors.

HyperCommGrid's rank lists are checked against hand-worked examples and megatron-core's own
RankGenerator (megatron-core's HyperCommGrid needs einops, which CI does not install); its groups
are created on 1, 2 and 4 gloo ranks.
"""

import itertools
import types

import pytest
import torch
import torch.distributed as dist

from megatron_core.distributed.finalize_model_grads import reset_model_temporary_tensors
from megatron_core.enums import Fp4Recipe, Fp8Recipe, ModelType
from megatron_core.errors import ConfigError, MegatronCoreError
from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.process_groups_config import ProcessGroupHelperMeta
from megatron_core.testing import run_distributed


def test_enums_match_megatron():
    mc_enums = pytest.importorskip("megatron.core.enums")
    for ours, theirs in [
        (ModelType, mc_enums.ModelType),
        (Fp8Recipe, mc_enums.Fp8Recipe),
        (Fp4Recipe, mc_enums.Fp4Recipe),
    ]:
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
        assert issubclass(ours, str) == issubclass(theirs, str)
    assert Fp8Recipe("mxfp8") is Fp8Recipe.mxfp8 and Fp8Recipe.delayed == "delayed"
    with pytest.raises(ValueError, match="encoder_or_decoder"):
        ModelType.encoder_or_decoder.encoder_and_decoder  # noqa: B018 (the read raises)


def test_process_group_helper_meta():
    class Holder(metaclass=ProcessGroupHelperMeta):
        virtual_pipeline_model_parallel_size = None

    Holder.other = 3
    assert Holder.other == 3
    with pytest.raises(AttributeError, match="set_virtual_pipeline_model_parallel_size"):
        Holder.virtual_pipeline_model_parallel_size = 2
    assert Holder.virtual_pipeline_model_parallel_size is None


class _Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.expert_bias = torch.zeros(4)
        self.local_tokens_per_expert = torch.arange(4.0)
        self.resets = 0

    def reset_global_aux_loss_tracker(self):
        self.resets += 1


def _wrapped_model():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), _Router())
    wrapper = types.SimpleNamespace(module=inner)  # a DDP-like wrapper without modules()
    return wrapper, inner[1]


@pytest.mark.parametrize(
    "enable_bias, balancing",
    [(True, "global_aux_loss"), (False, "aux_loss"), (True, ["seq_aux_loss", "global_aux_loss"])],
)
def test_reset_model_temporary_tensors_matches_megatron(enable_bias, balancing):
    mc_fmg = pytest.importorskip("megatron.core.distributed.finalize_model_grads")
    config = types.SimpleNamespace(
        moe_router_enable_expert_bias=enable_bias, moe_router_load_balancing_type=balancing
    )
    results = []
    for reset in (reset_model_temporary_tensors, mc_fmg.reset_model_temporary_tensors):
        wrapper, router = _wrapped_model()
        reset(config, [wrapper])
        results.append((router.local_tokens_per_expert.tolist(), router.resets))
    assert results[0] == results[1]
    wrapper, router = _wrapped_model()
    reset_model_temporary_tensors(object(), [wrapper])  # no MoE fields: nothing is reset
    assert router.resets == 0 and router.local_tokens_per_expert.tolist() == [0, 1, 2, 3]


# --- HyperCommGrid: rank lists (no processes) ------------------------------------------------


def test_hyper_grid_worked_example(monkeypatch):
    """The example of NOTE [ Hyper grid ranks ], rule 3."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid([2, 2, 2], ["tp", "pp", "dp"])
    assert grid.size == 8 and grid.shape == [2, 2, 2]
    assert grid.get_rank_enum("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.get_rank_enum("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.get_rank_enum(["tp", "dp"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert grid.get_rank_enum(["dp", "tp"]) == grid.get_rank_enum(["tp", "dp"])
    assert grid._order_dims(["tp", "dp"]) == (["dp", "tp"], "dp-tp")
    assert grid._gen_rank_enum(["tp", "pp"]) == [[0, 2, 1, 3], [4, 6, 5, 7]]  # as given
    offset = HyperCommGrid([2, 2], ["a", "b"], rank_offset=3)
    assert offset.get_rank_enum("b") == [[3, 5], [4, 6]]


@pytest.mark.parametrize(
    "tp, cp, ep, dp, pp", [(2, 1, 1, 2, 2), (2, 2, 1, 4, 2), (1, 2, 1, 3, 2), (4, 1, 1, 1, 2)]
)
def test_hyper_grid_matches_megatron_rank_generator(tp, cp, ep, dp, pp, monkeypatch):
    mc_ps = pytest.importorskip("megatron.core.parallel_state")
    monkeypatch.setenv("WORLD_SIZE", str(tp * cp * ep * dp * pp + 2))
    names = ["tp", "cp", "ep", "dp", "pp"]
    for offset in (0, 2):
        grid = HyperCommGrid([tp, cp, ep, dp, pp], names, rank_offset=offset)
        generator = mc_ps.RankGenerator(tp, ep, dp, pp, cp, "-".join(names), rank_offset=offset)
        for k in (1, 2, 3):
            for dims in itertools.combinations(names, k):
                expected = generator.get_ranks("-".join(dims))
                assert grid.get_rank_enum(list(dims)) == expected, dims


def test_hyper_grid_errors(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(MegatronCoreError, match="WORLD_SIZE"):
        HyperCommGrid([2], ["tp"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"\[2, 2\].*\['tp'\]"):
        HyperCommGrid([2, 2], ["tp"])
    with pytest.raises(ConfigError, match=r"rank_offset \(-1\)"):
        HyperCommGrid([2], ["tp"], rank_offset=-1)
    with pytest.raises(RuntimeError, match="world size 4 from rank offset 1"):
        HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=1)
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    with pytest.raises(ValueError, match="unknown dims.*'pp'"):
        grid.get_rank_enum(["tp", "pp"])
    with pytest.raises(KeyError, match="create_pg first"):
        grid.get_pg("tp")


# --- HyperCommGrid: real groups on gloo ranks -----------------------------------------------------


def _body_hyper_grid_groups(shape, names, rank_offset, dims_list):
    rank = dist.get_rank()
    grid = HyperCommGrid(shape, names, rank_offset=rank_offset)
    for dims in dims_list:
        pg = grid.create_pg(dims)
        assert grid.get_pg(dims) is pg
        mine = [g for g in grid.get_rank_enum(dims) if rank in g]
        if not mine:
            assert pg is None  # outside the grid
            continue
        assert dist.get_process_group_ranks(pg) == mine[0]
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=pg)  # a real group: sums exactly its members
        assert total.item() == sum(mine[0])
        with pytest.raises(KeyError, match="has already been created"):
            grid.create_pg(dims)  # raised before any collective, on every rank
    return sorted(grid._pgs)


@pytest.mark.parametrize(
    "world_size, shape, names, rank_offset, dims_list",
    [
        (1, [1, 1], ["tp", "dp"], 0, ["tp", ["dp", "tp"]]),
        (2, [2, 1], ["tp", "dp"], 0, ["tp", "dp", ["tp", "dp"]]),
        (4, [2, 2], ["tp", "dp"], 0, ["dp", "tp", ["dp", "tp"]]),
        (4, [1, 2], ["cp", "dp"], 2, ["dp", ["cp", "dp"]]),
    ],
)
def test_hyper_grid_create_pg(world_size, shape, names, rank_offset, dims_list):
    keys = run_distributed(
        _body_hyper_grid_groups, world_size, shape, names, rank_offset, dims_list, timeout=120
    )
    expected = sorted(
        HyperCommGrid._order_dims(types.SimpleNamespace(dim_names=names), d)[1] for d in dims_list
    )
    assert keys == [expected] * world_size


def test_param_is_not_tensor_parallel_duplicate_takes_any_group_like_object():
    """megatron-core reads ``tp_group.rank()``: any object with rank() will do (no process)."""
    from megatron_core.tensor_parallel import param_is_not_tensor_parallel_duplicate as ours

    mc_layers = pytest.importorskip("megatron.core.tensor_parallel.layers")
    split = torch.nn.Parameter(torch.zeros(2))
    split.tensor_model_parallel = True
    replicated = torch.nn.Parameter(torch.zeros(2))
    for rank in (0, 1, 3):
        group = types.SimpleNamespace(rank=lambda rank=rank: rank)
        for param in (split, replicated):
            expected = mc_layers.param_is_not_tensor_parallel_duplicate(param, group)
            assert ours(param, group) == expected == (param is split or rank == 0)
