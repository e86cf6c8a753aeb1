"""parallel_state's megatron-core module globals (NOTE [ Module globals ]) and the caller's-order
check of initialize_model_parallel: 1, 2, 4 gloo ranks, and 8 for the rank layout."""

import re
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.megatron import megatron_core_version
from megatron_core.parallel_state.layout import validate_sizes
from megatron_core.parallel_state.module_globals import MODULE_GLOBALS, MODULE_GLOBALS_0_19
from megatron_core.testing import run_distributed

# 0.16.1's globals that 0.19 no longer has (kept here: 0.16.1 is served exactly).
REMOVED_IN_0_19 = {"_DATA_PARALLEL_GROUP_WITH_CP_AG", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER"}


def _megatron_global_names():
    """The installed megatron-core's upper-case module globals, read from its source (not
    imported)."""
    mc_ps = pytest.importorskip("megatron.core.parallel_state")
    source = Path(mc_ps.__file__).read_text()
    return set(re.findall(r"^(_[A-Z][A-Z0-9_]*)\s*=", source, re.M))


def test_every_megatron_global_is_served():
    names = _megatron_global_names()
    if megatron_core_version().startswith("0.19."):
        assert names == set(MODULE_GLOBALS) - REMOVED_IN_0_19
    else:  # 0.16.1: ours are its globals and 0.19's new ones
        assert names == set(MODULE_GLOBALS) - MODULE_GLOBALS_0_19
    for name in sorted(names):  # not initialized: what megatron-core holds before initialization
        assert getattr(ps, name) == ({} if name == "_HYBRID_DP_CP_GROUPS" else None), name
    assert set(MODULE_GLOBALS) <= set(dir(ps))
    with pytest.raises(AttributeError, match="_NO_SUCH_GLOBAL"):
        ps._NO_SUCH_GLOBAL  # noqa: B018


def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _body_globals(tp, pp):
    ps.initialize_model_parallel(tp, pp, create_gloo_process_groups=True)
    getters = {
        "_TENSOR_MODEL_PARALLEL_GROUP": ps.get_tensor_model_parallel_group(),
        "_PIPELINE_MODEL_PARALLEL_GROUP": ps.get_pipeline_model_parallel_group(),
        "_MODEL_PARALLEL_GROUP": ps.get_model_parallel_group(),
        "_DATA_PARALLEL_GROUP": ps.get_data_parallel_group(),
        "_DATA_PARALLEL_GROUP_GLOO": ps.get_data_parallel_group_gloo(),
        "_DATA_PARALLEL_GROUP_WITH_CP": ps.get_data_parallel_group(with_context_parallel=True),
        "_CONTEXT_PARALLEL_GROUP": ps.get_context_parallel_group(),
        "_EXPERT_MODEL_PARALLEL_GROUP": ps.get_expert_model_parallel_group(),
        "_EXPERT_DATA_PARALLEL_GROUP": ps.get_expert_data_parallel_group(),
        "_TENSOR_AND_DATA_PARALLEL_GROUP": ps.get_tensor_and_data_parallel_group(),
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": (
            ps.get_intra_distributed_optimizer_instance_group()
        ),
        "_EMBEDDING_GROUP": ps.get_embedding_group(check_initialized=False),
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": None,  # one optimizer instance
    }
    for name, group in getters.items():
        assert getattr(ps, name) is group, name
    assert ps._PIPELINE_GLOBAL_RANKS == _ranks(ps.get_pipeline_model_parallel_group())
    assert ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS == _ranks(ps.get_tensor_model_parallel_group())
    assert ps._DATA_PARALLEL_GLOBAL_RANKS == _ranks(ps.get_data_parallel_group())
    assert ps._EMBEDDING_GLOBAL_RANKS == _ranks(getters["_EMBEDDING_GROUP"])
    assert ps._GLOBAL_MEMORY_BUFFER is ps.get_global_memory_buffer()
    # Assignment reaches the getters (rule 2) ...
    assert ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None
    ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = 7
    assert ps.get_tensor_model_parallel_world_size() == 7
    ps.set_tensor_model_parallel_world_size(None)
    assert ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None
    assert ps.get_tensor_model_parallel_world_size() == tp
    ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = 2
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    # ... and unittest.mock's patch restores the group on exit (it deletes, then reads).
    tp_group, stand_in = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    with mock.patch("megatron_core.parallel_state._TENSOR_MODEL_PARALLEL_GROUP", stand_in):
        assert ps.get_tensor_model_parallel_group() is stand_in
    assert ps.get_tensor_model_parallel_group() is tp_group
    ps.destroy_model_parallel()
    for name in MODULE_GLOBALS:  # None after destroy, as megatron-core's test checks
        assert getattr(ps, name) == ({} if name == "_HYBRID_DP_CP_GROUPS" else None), name


@pytest.mark.parametrize("world_size, tp, pp", [(1, 1, 1), (2, 1, 2), (4, 2, 2)])
def test_module_globals_follow_the_state(world_size, tp, pp):
    run_distributed(_body_globals, world_size, tp, pp, timeout=120)


def test_order_is_checked_as_the_caller_wrote_it():
    """'tp-ep-dp-pp' ends in pp; its grids append the omitted 'cp' after it (no processes)."""
    sizes = validate_sizes(8, 1, 2, expert_model_parallel_size=2, order="tp-ep-dp-pp")
    assert (sizes.dp, sizes.expert_dp) == (4, 2)
    assert sizes.dense_grid().order == "tp-ep-dp-pp-cp"
    with pytest.raises(AssertionError, match="does not end in 'pp'"):
        validate_sizes(8, 1, 2, expert_model_parallel_size=2, order="tp-ep-pp-dp")


_KINDS = {
    "tp": ps.get_tensor_model_parallel_group,
    "dp": ps.get_data_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "cp": ps.get_context_parallel_group,
    "mp": ps.get_model_parallel_group,
    "ep": ps.get_expert_model_parallel_group,
    "expt-dp": ps.get_expert_data_parallel_group,
    "tp-ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp-dp": ps.get_tensor_and_data_parallel_group,
}


def _body_orders(cases):
    """For each (tp, pp, ep, order): this rank's group ranks of every kind."""
    found = []
    for tp, pp, ep, order in cases:
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, order=order)
        found.append({kind: _ranks(get()) for kind, get in _KINDS.items()})
        ps.destroy_model_parallel()
    return found


def test_expert_orders_at_8_ranks():
    """The issue's case and two of megatron-core's order-consistency cases, against its own
    RankGenerator (dense grid tp/cp/dp/pp, expert grid tp/ep/expert-dp/pp)."""
    mc_ps = pytest.importorskip("megatron.core.parallel_state")
    cases = [(1, 2, 2, "tp-ep-dp-pp"), (2, 1, 4, "tp-ep-dp-pp"), (2, 1, 4, "tp-pp-ep-dp")]
    per_rank = run_distributed(_body_orders, 8, cases, timeout=180)
    for i, (tp, pp, ep, order) in enumerate(cases):
        dp, expert_dp = 8 // (tp * pp), 8 // (tp * ep * pp)
        dense = mc_ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
        expert = mc_ps.RankGenerator(tp=tp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order)
        tokens = {"mp": "tp-pp", "expt-dp": "dp", "tp-ep": "tp-ep", "ep": "ep"}
        for rank, found in enumerate(per_rank):
            for kind, ranks in found[i].items():
                grid = expert if kind in ("ep", "expt-dp", "tp-ep") else dense
                mine = [g for g in grid.get_ranks(tokens.get(kind, kind)) if rank in g]
                assert ranks == mine[0], (order, rank, kind)
    # megatron-core's own test: the two orders give the same groups for (tp 2, ep 4)
    assert [f[1] for f in per_rank] == [f[2] for f in per_rank]
