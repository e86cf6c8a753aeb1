"""megatron-core 0.17-0.19 names in parallel_state, process_groups_config and ModelParallelConfig.

On real gloo ranks: ``create_all_gather_groups`` returns new communicators over exactly the
data x context (and expert data) ranks, and an all-gather on them equals the one on
parallel_state's own group; the generalized-TP getters give one-rank groups (remat size 1);
``with_gtp_remat`` changes nothing at that size; ``rank_offset`` / ``local_world_size`` lay the
grid over a sub-range of ranks; a remat size above 1 raises one ConfigError naming the option.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_core import ModelParallelConfig
from megatron_core import parallel_state as ps
from megatron_core.errors import ConfigError, MegatronCoreError
from megatron_core.process_groups_config import (
    MultiModuleProcessGroupCollection,
    ProcessGroupCollection,
)
from megatron_core.testing import run_distributed

# world size -> (tp, ep): expert parallelism wherever the world allows it.
CONFIGS = {1: (1, 1), 2: (1, 2), 4: (2, 2)}


def _all_gather(group) -> list[float]:
    x = torch.tensor([float(dist.get_rank())])
    out = [torch.zeros(1) for _ in range(group.size())]
    dist.all_gather(out, x, group=group)
    return [t.item() for t in out]


def _all_gather_groups_body(tp, ep):
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep, gtp_remat_size=1)
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    expt_dp = ps.get_expert_data_parallel_group()
    dp_cp_ag, expt_dp_ag = ps.create_all_gather_groups(for_expert_parallelism=True)
    only_dense = ps.create_all_gather_groups()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.dp_cp_ag, pgs.expt_dp_ag = dp_cp_ag, expt_dp_ag
    return {
        "ag_ranks": dist.get_process_group_ranks(dp_cp_ag),
        "dp_cp_ranks": dist.get_process_group_ranks(dp_cp),
        "separate": dp_cp_ag is not dp_cp and only_dense[0] is not dp_cp_ag,
        "gathered": (_all_gather(pgs.dp_cp_ag), _all_gather(dp_cp)),
        "expt": None if expt_dp_ag is None else dist.get_process_group_ranks(expt_dp_ag),
        "expt_dp_ranks": dist.get_process_group_ranks(expt_dp),
        "expt_gathered": None if expt_dp_ag is None else _all_gather(expt_dp_ag),
        "only_dense_expt": only_dense[1],
        "pgs_defaults": (
            ProcessGroupCollection.use_mpu_process_groups(["dp_cp_ag", "expt_dp_ag"]).dp_cp_ag,
            pgs.dp_cp_gtp_remat is pgs.dp_cp,
            pgs.expt_dp_gtp_remat is pgs.expt_dp,
            pgs.tp_ep_pp_with_egtp_remat is pgs.tp_ep_pp,
            ProcessGroupCollection.is_gtp_remat_active(
                {"gtp_remat_group": pgs.gtp_remat, "expt_gtp_remat_group": pgs.expt_gtp_remat}
            ),
        ),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_create_all_gather_groups(world_size):
    """New communicators with the data-parallel ranks; collectives on them give the same result
    as on parallel_state's groups (an all-gather of each rank's id: exact)."""
    tp, ep = CONFIGS[world_size]
    for rank, seen in enumerate(run_distributed(_all_gather_groups_body, world_size, tp, ep)):
        assert seen["ag_ranks"] == seen["dp_cp_ranks"], rank
        assert seen["separate"] or world_size == 1, rank
        assert seen["gathered"][0] == seen["gathered"][1] == [float(r) for r in seen["ag_ranks"]]
        if ep > 1:
            assert seen["expt"] == seen["expt_dp_ranks"]
            assert seen["expt_gathered"] == [float(r) for r in seen["expt"]]
        else:
            assert seen["expt"] is None  # megatron-core: only with expert parallelism
        assert seen["only_dense_expt"] is None
        assert seen["pgs_defaults"] == (None, True, True, True, False)


def _gtp_body():
    rank = dist.get_rank()
    ps.initialize_model_parallel(1, expert_gtp_remat_size=1)
    seen = {
        "gtp": (
            ps.get_gtp_weight_remat_world_size(),
            ps.get_gtp_weight_remat_rank(),
            ps.get_gtp_weight_remat_global_ranks(),
            dist.get_process_group_ranks(ps.get_gtp_weight_remat_group()),
        ),
        "expt_gtp": (
            ps.get_expert_gtp_weight_remat_world_size(),
            ps.get_expert_gtp_weight_remat_rank(),
            ps.get_expert_gtp_weight_remat_global_ranks(),
        ),
        "same": (
            ps._GTP_WEIGHT_REMAT_GROUP is ps.get_gtp_weight_remat_group(),
            ps._EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS == [rank],
            ps._DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT
            is ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_data_parallel_group(with_gtp_remat=False) is ps.get_data_parallel_group(),
            ps.get_data_parallel_world_size(True, with_gtp_remat=False)
            == ps.get_data_parallel_world_size(True),
            ps.get_data_parallel_rank(with_gtp_remat=False) == ps.get_data_parallel_rank(),
            ps.get_expert_data_parallel_group(with_gtp_remat=False)
            is ps.get_expert_data_parallel_group(),
            ps.get_expert_data_parallel_rank(with_gtp_remat=False)
            == ps.get_expert_data_parallel_rank(),
            ps.get_expert_data_parallel_world_size(with_gtp_remat=False)
            == ps.get_expert_data_parallel_world_size(),
            ps.get_expert_tensor_model_pipeline_parallel_group(True, True)
            is ps.get_expert_tensor_model_pipeline_parallel_group(),
        ),
    }
    ps.destroy_model_parallel()
    errors = []
    for kwargs in ({"gtp_remat_size": 2}, {"expert_gtp_remat_size": 4}):
        with pytest.raises(ConfigError, match="generalized tensor parallelism") as info:
            ps.initialize_model_parallel(1, **kwargs)
        errors.append(str(info.value))
    seen["errors"] = errors
    seen["rank"] = rank
    return seen


@pytest.mark.parametrize("world_size", [1, 2])
def test_gtp_getters_and_remat_refusal(world_size):
    """Remat size 1: one-rank groups, the data-parallel getters unchanged by with_gtp_remat.
    A size above 1 raises on every rank, the message naming the option and its value."""
    for seen in run_distributed(_gtp_body, world_size):
        rank = seen["rank"]
        assert seen["gtp"] == (1, 0, [rank], [rank])
        assert seen["expt_gtp"] == (1, 0, [rank])
        assert all(seen["same"])
        assert "gtp_remat_size (2)" in seen["errors"][0]
        assert "expert_gtp_remat_size (4)" in seen["errors"][1]


def _rank_offset_body():
    with pytest.raises(MegatronCoreError, match="initialize_model_parallel"):
        ps.create_all_gather_groups()  # before initialization: raises on every rank
    with pytest.raises(MegatronCoreError, match=r"rank_offset \(3\) \+ local_world_size \(2\)"):
        ps.initialize_model_parallel(2, rank_offset=3, local_world_size=2)
    ps.initialize_model_parallel(2, rank_offset=2, local_world_size=2)
    group = ps.get_tensor_model_parallel_group(check_initialized=False)
    return None if group is None else dist.get_process_group_ranks(group)


def test_rank_offset_and_local_world_size():
    """4 ranks, grid over ranks 2-3 with tp=2: they form one tensor group, 0-1 belong to none.
    Bad ranges and use before initialization raise on every rank, naming the values."""
    assert run_distributed(_rank_offset_body, 4) == [None, None, [2, 3], [2, 3]]


def test_config_weight_shards_and_refusal():
    """0.19's fields: the shards resolve the remat size; a size above 1 raises naming it."""
    config = ModelParallelConfig(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=2)
    assert (config.gtp_weight_remat_size, config.expert_gtp_weight_remat_size) == (1, 1)
    with pytest.raises(ConfigError, match=r"gtp_weight_remat_size .*\(2\) > 1"):
        ModelParallelConfig(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=4)
    with pytest.raises(ConfigError, match="expert_gtp_weight_remat_size"):
        ModelParallelConfig(expert_gtp_weight_remat_size=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_num_weight_shards \(3\)"):
        ModelParallelConfig(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=3)
    with pytest.raises(ConfigError, match="gtp_remat"):
        ps.RankGenerator(1, 1, 2, 1, 1, "tp-dp", 0, 2)
    assert ps.RankGenerator(1, 1, 2, 1, 1, "tp-dp", 4).get_gtp_ranks(1) == [[4], [5]]


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_multi_module_process_group_collection():
    vision, llm = ProcessGroupCollection(cp=_Group(1)), ProcessGroupCollection(cp=_Group(2))
    pgs = MultiModuleProcessGroupCollection({"vision": vision, "llm": llm}, "llm")
    assert pgs.get_language_model_cp_size() == 2 and pgs.has_language_model()
    assert pgs["vision"] is vision and pgs.get_module_collection("llm") is llm
    assert list(pgs) == [vision, llm] and list(pgs.keys()) == ["vision", "llm"] and len(pgs) == 2
    no_lm = MultiModuleProcessGroupCollection({"vision": vision})
    with pytest.raises(ValueError, match="no language model"):
        no_lm.get_language_model_collection()
    with pytest.raises(ValueError, match="'text'"):
        MultiModuleProcessGroupCollection({"vision": vision}, "text")
    with pytest.raises(ValueError, match="empty"):
        MultiModuleProcessGroupCollection({})


def test_setup_helpers_return_the_019_keys():
    """megatron-core 0.19's DDP and optimizer read the weight-remat groups from these dicts."""
    tp, dp, ep, pp, mp, expt, tep, gtp = (object() for _ in range(8))
    pgs = ProcessGroupCollection(
        tp=tp, pp=pp, ep=ep, dp=dp, expt_dp=expt, mp=mp, tp_ep_pp=tep, gtp_remat=gtp
    )
    ddp_config = SimpleNamespace(num_distributed_optimizer_instances=1)
    groups = ProcessGroupCollection.setup_process_groups_for_ddp(pgs, None, ddp_config)
    assert groups["gtp_remat_group"] is gtp and groups["expt_gtp_remat_group"] is None
    chunk = SimpleNamespace(ddp_config=ddp_config, config=SimpleNamespace(context_parallel_size=1))
    opt = ProcessGroupCollection.setup_process_groups_for_optimizer(pgs, [chunk], False)
    assert opt["expt_tp_pp_with_egtp_remat_group"] is tep and opt["gtp_remat_group"] is gtp
    assert ProcessGroupCollection.is_gtp_remat_active({"gtp_remat_group": _Group(2)})
    assert not ProcessGroupCollection.is_gtp_remat_active({"expt_gtp_remat_group": _Group(1)})
