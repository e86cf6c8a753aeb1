"""parallel_state on real gloo ranks: groups, getters, errors on every rank, re-initialization.

Every group a getter returns is compared with compute_rank_layout (itself checked against
hand-written megatron-core 0.16 tables in test_rank_grid.py), and real collectives run over them.
"""

import datetime
import importlib.util
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core import parallel_state as ps
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state import create as _parallel_setup
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.testing import run_distributed
from megatron_core.utils import GlobalMemoryBuffer

# (tp, pp, cp, ep, etp, order) per world size; several configs share one set of worker processes.
CONFIGS = {
    1: [(1, 1, 1, 1, None, "tp-cp-ep-dp-pp")],
    2: [(2, 1, 1, 1, None, "tp-cp-ep-dp-pp"), (1, 1, 2, 2, None, "tp-cp-ep-dp-pp")],
    4: [
        (2, 2, 1, 1, None, "tp-cp-ep-dp-pp"),
        (1, 2, 1, 2, None, "tp-cp-ep-dp-pp"),
        (1, 2, 1, 1, None, "tp-pp-dp"),
        (2, 1, 2, 2, 1, "tp-cp-ep-dp-pp"),
        (1, 1, 4, 4, None, "tp-cp-ep-dp-pp"),
    ],
    8: [(2, 2, 2, 2, 1, "tp-cp-ep-dp-pp"), (1, 1, 4, 4, None, "tp-cp-ep-dp-pp")],
}

GROUP_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "dp": ps.get_data_parallel_group,
    "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "cp": ps.get_context_parallel_group,
    "mp": ps.get_model_parallel_group,
    "tp-cp": ps.get_tensor_and_context_parallel_group,
    "tp-dp": ps.get_tensor_and_data_parallel_group,
    "tp-dp-cp": lambda: ps.get_amax_reduction_group(with_context_parallel=True),
    "ep": ps.get_expert_model_parallel_group,
    "expt-tp": ps.get_expert_tensor_parallel_group,
    "tp-ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp-ep-pp": ps.get_expert_tensor_model_pipeline_parallel_group,
    "expt-dp": ps.get_expert_data_parallel_group,
    "intra-dist-opt": ps.get_intra_distributed_optimizer_instance_group,
    "embedding": lambda: ps.get_embedding_group(check_initialized=False),
    "position_embedding": lambda: ps.get_position_embedding_group(check_initialized=False),
}


def _observe() -> dict:
    """What this rank sees through the public getters and real collectives."""
    seen = {}
    for kind, get in GROUP_GETTERS.items():
        group = get()
        seen[kind] = None if group is None else dist.get_process_group_ranks(group)
    # Real collectives: the sum of global ranks over the tensor and the expert-parallel groups.
    for kind, group in (
        ("tp", ps.get_tensor_model_parallel_group()),
        ("ep", ps.get_expert_model_parallel_group()),
    ):
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=group)
        seen[f"{kind}_sum"] = int(x.item())
    seen["scalars"] = _scalars()
    # megatron-core's unit tests: a setter given None falls back to the group's value again.
    for setter in SETTERS:
        setter(7)
    seen["overridden"] = _sizes_and_ranks()
    for setter in SETTERS:
        setter(None)
    seen["reverted"] = _scalars() == seen["scalars"]
    seen["gloo"] = dist.get_process_group_ranks(ps.get_data_parallel_group_gloo())
    seen["expt_gloo"] = dist.get_process_group_ranks(ps.get_expert_data_parallel_group_gloo())
    return seen


SETTERS = (
    ps.set_tensor_model_parallel_rank,
    ps.set_tensor_model_parallel_world_size,
    ps.set_pipeline_model_parallel_rank,
    ps.set_pipeline_model_parallel_world_size,
    ps.set_data_parallel_rank,
    ps.set_expert_model_parallel_rank,
    ps.set_expert_model_parallel_world_size,
    ps.set_expert_tensor_parallel_rank,
    ps.set_expert_tensor_parallel_world_size,
)


def _sizes_and_ranks() -> tuple:
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
        ps.get_context_parallel_rank(),
        ps.get_context_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_data_parallel_rank(),
        ps.get_expert_data_parallel_world_size(),
    )


def _scalars() -> tuple:
    return _sizes_and_ranks() + (
        ps.get_tensor_model_parallel_src_rank(),
        ps.get_data_parallel_src_rank(),
        ps.get_model_parallel_src_rank(),
        ps.get_expert_model_parallel_src_rank(),
        ps.get_pipeline_model_parallel_first_rank(),
        ps.get_pipeline_model_parallel_last_rank(),
        ps.get_pipeline_model_parallel_next_rank(),
        ps.get_pipeline_model_parallel_prev_rank(),
        ps.is_pipeline_first_stage(),
        ps.is_pipeline_last_stage(),
        ps.is_rank_in_embedding_group(),
        ps.is_rank_in_position_embedding_group(),
    )


def _body_layouts(configs):
    results = []
    for tp, pp, cp, ep, etp, order in configs:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            order=order,
        )
        results.append(_observe())
        ps.destroy_model_parallel()  # re-initializing after destroy must work
    return results


def _group_of(layout, kind, rank):
    """This rank's group of `kind` in a layout (None: rank is in no embedding group)."""
    groups = [g for g in layout[kind] if rank in g]
    assert len(groups) == 1 or (not groups and "embedding" in kind), (kind, rank, groups)
    return groups[0] if groups else None


@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_groups_on_real_ranks_match_layout(world_size):
    per_rank = run_distributed(_body_layouts, world_size, CONFIGS[world_size], timeout=240)
    for i, (tp, pp, cp, ep, etp, order) in enumerate(CONFIGS[world_size]):
        layout = ps.compute_rank_layout(
            world_size, tp, pp, cp, ep, order, expert_tensor_parallel_size=etp
        )
        for rank, results in enumerate(per_rank):
            seen = results[i]
            mine = {kind: _group_of(layout, kind, rank) for kind in GROUP_GETTERS}
            for kind in GROUP_GETTERS:  # torch reports a group's ranks sorted
                assert seen[kind] == (mine[kind] and sorted(mine[kind])), (kind, rank)
            stage = mine["pp"].index(rank)
            expected = (
                mine["tp"].index(rank), tp,
                stage, pp,
                mine["dp"].index(rank), len(mine["dp"]),
                mine["cp"].index(rank), cp,
                mine["ep"].index(rank), ep,
                mine["expt-tp"].index(rank), len(mine["expt-tp"]),
                mine["expt-dp"].index(rank), world_size // (len(mine["expt-tp"]) * ep * pp),
                mine["tp"][0], mine["dp"][0], mine["mp"][0], mine["ep"][0],
                mine["pp"][0], mine["pp"][-1],
                mine["pp"][(stage + 1) % pp], mine["pp"][(stage - 1) % pp],
                stage == 0, stage == pp - 1,
                mine["embedding"] is not None, mine["position_embedding"] is not None,
            )  # fmt: skip
            assert seen["scalars"] == expected, (order, rank)
            # Every rank and size with a setter reads 7; the dp size, cp and expert dp have none.
            overridden = (7,) * 5 + expected[5:8] + (7,) * 4 + expected[12:14]
            assert seen["overridden"] == overridden, rank
            assert seen["reverted"]
            assert seen["tp_sum"] == sum(mine["tp"]) and seen["ep_sum"] == sum(mine["ep"])
            assert seen["gloo"] == mine["dp"] and seen["expt_gloo"] == mine["expt-dp"]


def _body_errors(world_size):
    messages = []

    def expect(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except MegatronCoreError as e:
            messages.append(str(e))
        else:
            messages.append("NO ERROR")

    expect(ps.get_tensor_model_parallel_rank)  # getter before initialize
    expect(ps.get_data_parallel_group)
    expect(ps.initialize_model_parallel, tensor_model_parallel_size=3)
    expect(ps.initialize_model_parallel, tensor_model_parallel_size=0)
    expect(ps.initialize_model_parallel, order="tp-foo-dp")
    expect(ps.initialize_model_parallel, expert_model_parallel_size=3)
    expect(ps.initialize_model_parallel, virtual_pipeline_model_parallel_size=2)
    expect(ps.initialize_model_parallel, sharp_enabled_group="dp")
    expect(ps.initialize_model_parallel, use_sharp=True, sharp_enabled_group="tp")
    expect(ps.initialize_model_parallel, pipeline_model_parallel_comm_backend="mpi")
    expect(ps.initialize_model_parallel, distributed_timeout_minutes=0)
    expect(ps.initialize_model_parallel, high_priority_stream_groups="dp_cp")
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    expect(ps.initialize_model_parallel)  # twice without destroy
    expect(ps.get_data_parallel_group, partial_data_parallel=True)
    ps.destroy_model_parallel()
    # Everything still works after all those refusals: no rank is stuck in a collective.
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    x = torch.ones(1)
    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    messages.append(int(x.item()))
    return messages


def test_bad_input_raises_on_every_rank_without_hanging():
    for messages in run_distributed(_body_errors, 4, 4, timeout=120):
        assert "not initialized" in messages[0] and "not initialized" in messages[1]
        assert "tensor_model_parallel_size (3)" in messages[2] and "world size (4)" in messages[2]
        assert "tensor_model_parallel_size (0) must be an integer >= 1" in messages[3]
        assert "unknown token(s) ['foo']" in messages[4]
        assert "expert_model_parallel_size (3)" in messages[5] and "= 3 must divide" in messages[5]
        assert "virtual_pipeline_model_parallel_size (2)" in messages[6]
        assert "only valid with use_sharp=True" in messages[7]
        assert "sharp_enabled_group ('tp') must be 'dp' or 'dp_replica'" in messages[8]
        assert "pipeline_model_parallel_comm_backend ('mpi')" in messages[9]
        assert "distributed_timeout_minutes (0)" in messages[10]
        assert "high_priority_stream_groups ('dp_cp') must be a list" in messages[11]
        assert "called twice" in messages[12]
        assert "partial_data_parallel=True needs with_context_parallel=True" in messages[13]
        assert messages[14] == 4


def test_initialize_without_torch_distributed_raises():
    assert not dist.is_initialized()
    with pytest.raises(MegatronCoreError, match="init_process_group"):
        ps.initialize_model_parallel()
    assert not ps.model_parallel_is_initialized()


def test_setters_and_getters_without_initialize():
    # megatron-core's unit tests set sizes and ranks without creating any group.
    try:
        assert ps.get_data_parallel_world_size() == 0  # no torch.distributed: 0, as in 0.16
        assert ps.get_expert_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        assert ps.get_expert_tensor_parallel_world_size() is None
        ps.set_tensor_model_parallel_world_size(4)
        ps.set_tensor_model_parallel_rank(3)
        ps.set_pipeline_model_parallel_world_size(2)
        ps.set_pipeline_model_parallel_rank(1)
        ps.set_data_parallel_rank(5)
        ps.set_expert_model_parallel_world_size(8)
        ps.set_expert_model_parallel_rank(7)
        ps.set_virtual_pipeline_model_parallel_world_size(3)
        assert ps.get_tensor_model_parallel_world_size() == 4
        assert ps.get_tensor_model_parallel_rank() == 3
        assert (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
        ) == (4, 3)
        ps.set_expert_tensor_parallel_world_size(2)
        ps.set_expert_tensor_parallel_rank(1)
        assert (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
        ) == (2, 1)
        assert ps.get_pipeline_model_parallel_world_size() == 2
        assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
        assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=2)
        assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
        with pytest.raises(MegatronCoreError, match="vp_stage must be passed"):
            ps.is_pipeline_first_stage(ignore_virtual=False)
        assert ps.get_data_parallel_rank() == 5
        assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (
            8,
            7,
        )
        assert not ps.is_initialized() and not ps.is_rank_in_embedding_group()
        assert not ps.is_rank_in_position_embedding_group()
        with pytest.warns(DeprecationWarning):
            assert ps.is_unitialized()
        with pytest.raises(MegatronCoreError, match="global memory buffer is not initialized"):
            ps.get_global_memory_buffer()
    finally:
        ps.destroy_model_parallel()
    with pytest.raises(MegatronCoreError, match="not initialized"):
        ps.get_tensor_model_parallel_world_size()  # destroy dropped the overrides
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None


def test_global_memory_buffer_reuses_one_allocation_per_name_and_dtype():
    buf = GlobalMemoryBuffer()
    a = buf.get_tensor((2, 3), torch.float32, "mpu")
    a.fill_(1.0)
    b = buf.get_tensor([6], torch.float32, "mpu")  # same name and dtype: same memory
    assert b.data_ptr() == a.data_ptr() and torch.equal(b, torch.ones(6))
    c = buf.get_tensor((4,), torch.bfloat16, "mpu")  # another dtype: another buffer
    assert c.dtype == torch.bfloat16 and c.data_ptr() != a.data_ptr()
    d = buf.get_tensor((5, 2), torch.float32, "mpu")  # larger: grows
    assert d.shape == (5, 2) and buf.buffer[("mpu", torch.float32)].numel() == 10


def _body_virtual_pipeline():
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    seen = []
    for chunk in range(2):
        seen.append(
            (
                ps.is_pipeline_first_stage(),
                ps.is_pipeline_last_stage(),
                ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk),
                ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=chunk),
                ps.is_rank_in_embedding_group(),
            )
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.set_virtual_pipeline_model_parallel_rank(1)
    seen.append((ps.get_virtual_pipeline_model_parallel_rank(), caught[0].category.__name__))
    ps.destroy_model_parallel()
    # A size set before initialize survives an initialize without the argument (megatron-core).
    ps.set_virtual_pipeline_model_parallel_world_size(4)
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    seen.append(ps.get_virtual_pipeline_model_parallel_world_size())
    return seen


def test_virtual_pipeline_stages():
    rank0, rank1 = run_distributed(_body_virtual_pipeline, 2)
    # ignore_virtual defaults to True (0.16); with vp_stage, stage 0 is "first" only on chunk 0
    # and stage 1 is "last" only on the last chunk.
    assert rank0[:2] == [
        (True, False, True, False, True, True),
        (True, False, False, False, False, True),
    ]
    assert rank1[:2] == [
        (False, True, False, False, False, True),
        (False, True, False, True, True, True),
    ]
    assert rank0[2] == (1, "DeprecationWarning") and rank0[3] == rank1[3] == 4


def _ranks_or_none(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _body_more_getters(tmp_config):
    out = {}
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=4,
        pipeline_model_parallel_split_rank=2,
        create_gloo_process_groups=False,
    )
    out["split"] = ps.get_pipeline_model_parallel_split_rank()
    out["embedding"] = _ranks_or_none(ps.get_embedding_group(check_initialized=False))
    out["position"] = _ranks_or_none(ps.get_position_embedding_group(check_initialized=False))
    out["in_groups"] = (ps.is_rank_in_embedding_group(), ps.is_rank_in_position_embedding_group())
    try:
        ps.get_data_parallel_group_gloo()
        out["no_gloo"] = "NO ERROR"
    except MegatronCoreError as e:
        out["no_gloo"] = str(e)
    ps.destroy_model_parallel()
    # NCCL-only options are accepted on gloo and have no effect (NOTE [ NCCL-only options ]).
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        hierarchical_context_parallel_sizes=[2],
        num_distributed_optimizer_instances=2,
        create_all_gather_group=True,
        use_sharp=True,
        high_priority_stream_groups=["dp_cp", "ep_dp"],
        nccl_communicator_config_path=tmp_config,
        distributed_timeout_minutes=7,
    )
    out["mp"] = (ps.get_model_parallel_rank(), ps.get_model_parallel_world_size())
    out["tp-cp"] = (
        ps.get_tensor_and_context_parallel_rank(),
        ps.get_tensor_and_context_parallel_world_size(),
    )
    out["dp-cp"] = (
        ps.get_data_parallel_rank(with_context_parallel=True),
        ps.get_data_parallel_world_size(with_context_parallel=True),
        ps.get_data_parallel_src_rank(with_context_parallel=True),
        _ranks_or_none(ps.get_data_parallel_group_gloo(with_context_parallel=True)),
    )
    out["cp_ranks"] = ps.get_context_parallel_global_ranks()
    out["hcp"] = [_ranks_or_none(g) for g in ps.get_hierarchical_context_parallel_groups()]
    ag = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    out["ag"] = (ps.has_separate_all_gather_group(), _ranks_or_none(ag),
                 ag is not ps.get_data_parallel_group(with_context_parallel=True))  # fmt: skip
    out["partial"] = [
        _ranks_or_none(ps.get_data_parallel_group(True, partial_data_parallel=True)),
        _ranks_or_none(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
        _ranks_or_none(ps.get_inter_distributed_optimizer_instance_group()),
        _ranks_or_none(ps.get_intra_distributed_optimizer_instance_group()),
    ]
    out["amax"] = [
        _ranks_or_none(ps.get_amax_reduction_group(w, t))
        for w in (False, True)
        for t in (False, True)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out["modulo"] = _ranks_or_none(ps.get_data_modulo_expert_parallel_group())
    out["all_ranks"] = ps.get_all_ranks()
    buffer = ps.get_global_memory_buffer()
    out["buffer"] = tuple(buffer.get_tensor((2, 2), torch.float32, "mpu").shape)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    subset = ProcessGroupCollection.use_mpu_process_groups(["tp", "pp", "cp"])
    out["subset"] = (hasattr(subset, "cp"), hasattr(subset, "dp"), hasattr(pgs, "hcp"))
    out["pgs"] = {
        name: _ranks_or_none(getattr(pgs, name)) for name in ("tp", "dp_cp", "ep", "inter_dist_opt")
    }
    ddp = SimpleNamespace(num_distributed_optimizer_instances=2, use_distributed_optimizer=True)
    for_ddp = ProcessGroupCollection.setup_process_groups_for_ddp(None, None, ddp)
    chunk = SimpleNamespace(ddp_config=ddp)
    for_opt = ProcessGroupCollection.setup_process_groups_for_optimizer(None, [chunk])
    out["setup"] = (
        _ranks_or_none(for_ddp["inter_dist_opt_group"]),
        _ranks_or_none(for_opt["intra_dp_cp_group_gloo"]),
        _ranks_or_none(for_opt["expt_tp_pp_group"]),
    )
    ps.update_pg_timeout(datetime.timedelta(minutes=9))
    x = torch.ones(1)
    dist.all_reduce(x, group=ps.get_data_parallel_group(with_context_parallel=True))
    out["after_timeout"] = int(x.item())
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
        hybrid_context_parallel=True,
    )
    out["hcp2"] = [_ranks_or_none(g) for g in ps.get_hierarchical_context_parallel_groups()]
    out["hybrid"] = [
        _ranks_or_none(ps.get_hybrid_data_context_parallel_groups(group_size=n)) for n in (2, 4)
    ]
    try:
        ps.get_hybrid_data_context_parallel_groups(group_size=8)
    except MegatronCoreError as e:
        out["hybrid8"] = str(e)
    ps.destroy_model_parallel()
    out["after_destroy"] = (
        ps.model_parallel_is_initialized(),
        ps.get_tensor_model_parallel_group(check_initialized=False),
    )
    return out


HAVE_YAML = importlib.util.find_spec("yaml") is not None


def _nccl_config(tmp_path):
    config = tmp_path / "nccl.yaml"
    config.write_text("dp_cp:\n  max_ctas: 16\ntp:\n  net_name: socket\n")
    return str(config)


def test_nccl_config_file_is_read_and_validated(tmp_path):
    path = _nccl_config(tmp_path)
    if HAVE_YAML:
        assert _parallel_setup.load_nccl_config(path) == {
            "dp_cp": {"max_ctas": 16},
            "tp": {"net_name": "socket"},
        }
        bad = tmp_path / "bad.yaml"
        bad.write_text("tp:\n  net_name: carrier-pigeon\n")
        with pytest.raises(MegatronCoreError, match=r"net_name \('carrier-pigeon'\)"):
            _parallel_setup.load_nccl_config(str(bad))
    else:  # the only optional dependency: its absence is a clear error, not a skip
        with pytest.raises(MegatronCoreError, match="needs the PyYAML package"):
            _parallel_setup.load_nccl_config(path)


def test_split_rank_nccl_options_partial_groups_and_more_getters(tmp_path):
    config = _nccl_config(tmp_path) if HAVE_YAML else None
    split = ps.compute_rank_layout(4, 1, 4, pipeline_model_parallel_split_rank=2)
    grid = ps.compute_rank_layout(4, 2, 1, 2, num_distributed_optimizer_instances=2)
    for rank, out in enumerate(run_distributed(_body_more_getters, 4, config, timeout=120)):
        emb = _group_of(split, "embedding", rank)
        pos = _group_of(split, "position_embedding", rank)
        assert out["split"] == 2
        assert (out["embedding"], out["position"]) == (emb, pos)
        assert emb in ([0, 2, 3], None) and pos in ([0, 2], None)
        assert out["in_groups"] == (emb is not None, pos is not None)
        assert "create_gloo_process_groups=False" in out["no_gloo"]
        mine = {kind: _group_of(grid, kind, rank) for kind in grid if kind in (
            "mp", "tp-cp", "dp-cp", "cp", "intra-dp-cp", "intra-expt-dp", "inter-dist-opt",
            "intra-dist-opt", "tp", "tp-dp", "tp-dp-cp", "expt-dp", "ep")}  # fmt: skip
        assert out["mp"] == (mine["mp"].index(rank), len(mine["mp"]))
        assert out["tp-cp"] == (mine["tp-cp"].index(rank), 4)
        assert out["dp-cp"] == (mine["dp-cp"].index(rank), 2, mine["dp-cp"][0], mine["dp-cp"])
        assert out["cp_ranks"] == mine["cp"] and out["hcp"] == [mine["cp"]]
        assert out["ag"] == (True, mine["dp-cp"], True)
        assert out["partial"] == [
            mine["intra-dp-cp"], mine["intra-expt-dp"], mine["inter-dist-opt"],
            mine["intra-dist-opt"],
        ]  # fmt: skip
        assert out["amax"] == [mine["tp-dp"], mine["tp"], mine["tp-dp-cp"], mine["tp-cp"]]
        assert out["modulo"] == mine["expt-dp"]
        tp_rank, cp_rank = mine["tp"].index(rank), mine["cp"].index(rank)
        assert out["all_ranks"] == f"{tp_rank}_0_{cp_rank}_0_0"
        assert out["buffer"] == (2, 2)
        assert out["pgs"] == {"tp": mine["tp"], "dp_cp": mine["dp-cp"], "ep": mine["ep"],
                              "inter_dist_opt": mine["inter-dist-opt"]}  # fmt: skip
        assert out["subset"] == (True, False, True)
        assert out["setup"] == (mine["inter-dist-opt"], mine["intra-dp-cp"], mine["tp"])
        assert out["after_timeout"] == 2
        # cp=4 as [2, 2]: inner pairs [0,1] [2,3], outer pairs [0,2] [1,3]; hybrid sizes 2 and 4.
        assert out["hcp2"] == [[rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]]
        assert out["hybrid"] == [[rank - rank % 2, rank - rank % 2 + 1], [0, 1, 2, 3]]
        assert (
            "no hybrid data x context parallel group of size 8; sizes created: [2]"
            in out["hybrid8"]
        )
        assert out["after_destroy"] == (False, None)


def _body_reinitialize_reuses_groups():
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_first = ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, distributed_timeout_minutes=5)
    tp_again = ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)  # another layout: other groups
    tp_other = ps.get_tensor_model_parallel_group()
    x = torch.ones(1)
    dist.all_reduce(x, group=tp_again)  # the reused group still communicates
    return tp_again is tp_first, tp_other is tp_first, int(x.item())


def test_reinitialize_after_destroy_reuses_the_same_groups():
    # destroy_model_parallel drops the state but keeps the communicators (as megatron-core does);
    # the same layout gets the same ProcessGroup objects back, even with another timeout.
    for same, other, total in run_distributed(_body_reinitialize_reuses_groups, 4):
        assert (same, other, total) == (True, False, 2)


def test_process_group_collection_holds_only_what_it_was_given():
    pgs = ProcessGroupCollection(tp=None)
    assert hasattr(pgs, "tp") and not hasattr(pgs, "dp")
    assert repr(pgs) == "ProcessGroupCollection(tp(None))"
    pgs.hcp = [None, None]  # set after creation, as megatron-core's tests do
    assert repr(pgs) == "ProcessGroupCollection(tp(None), hcp(2))"
    assert repr(ProcessGroupCollection()) == "ProcessGroupCollection(empty)"
    with pytest.raises(ValueError, match="Unknown attribute: tpp"):
        ProcessGroupCollection(tpp=None)
    with pytest.raises(ValueError, match=r"Invalid process groups requested: \['zz'\]"):
        ProcessGroupCollection.use_mpu_process_groups(["tp", "zz"])


def test_setup_helpers_with_an_explicit_collection():
    tp, dp, ep, pp, mp, expt, tep = (object() for _ in range(7))
    pgs = ProcessGroupCollection(tp=tp, pp=pp, ep=ep, dp=dp, expt_dp=expt, mp=mp, tp_ep_pp=tep)
    ddp_config = SimpleNamespace(
        num_distributed_optimizer_instances=1, use_distributed_optimizer=False
    )
    groups = ProcessGroupCollection.setup_process_groups_for_ddp(pgs, None, ddp_config)
    assert groups["dp_cp_group"] is dp and groups["intra_expt_dp_group"] is expt
    assert (groups["tp_group"], groups["pp_group"], groups["ep_group"]) == (tp, pp, ep)
    chunk = SimpleNamespace(ddp_config=ddp_config, config=SimpleNamespace(context_parallel_size=1))
    opt = ProcessGroupCollection.setup_process_groups_for_optimizer(pgs, [chunk], False)
    assert opt["mp_group"] is mp and opt["expt_tp_pp_group"] is tep
    assert opt["inter_dist_opt_group"] is None and opt["intra_dist_opt_group"] is None
    chunk.config.context_parallel_size = 2
    with pytest.raises(ValueError, match=r"dp_cp process group is required .* \(2\)"):
        ProcessGroupCollection.setup_process_groups_for_optimizer(pgs, [chunk], False)
    chunk.ddp_config.num_distributed_optimizer_instances = 2
    pgs.dp_cp = dp
    with pytest.raises(ValueError, match="intra_dp_cp process group is required"):
        ProcessGroupCollection.setup_process_groups_for_optimizer(pgs, [chunk], False)
    with pytest.raises(ValueError, match="Gloo process groups are not supported"):
        chunk.ddp_config.num_distributed_optimizer_instances = 1
        ProcessGroupCollection.setup_process_groups_for_optimizer(pgs, [chunk], True)


def _body_expert_rng(etp):
    from megatron_core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with tensor_parallel.get_cuda_rng_tracker().fork("expert-parallel-rng"):
        draw = torch.rand(4, device=device.current_device()).cpu()  # the stream's device
    report = tensor_parallel.audit_rng_streams(raise_on_violation=True)
    return draw, ps.get_expert_tensor_parallel_rank(), report.ok


@pytest.mark.parametrize("etp", [1, 2])
def test_expert_rng_stream_follows_the_expert_tensor_parallel_rank(etp):
    # seed + 1024 + 100 * ep_rank + etp_rank: with etp = 1 both tensor ranks hold the same expert
    # shard and must draw the same numbers; with etp = 2 they hold different shards.
    (draw0, etp0, ok0), (draw1, etp1, ok1) = run_distributed(_body_expert_rng, 2, etp)
    assert (etp0, etp1) == ((0, 0) if etp == 1 else (0, 1)) and ok0 and ok1
    assert torch.equal(draw0, draw1) == (etp == 1)


def test_nccl_options_from_a_config():
    cfgs = {}
    ps.overwrite_nccl_comm_cfgs(cfgs, "tp", ("is_high_priority_stream", True))
    ps.overwrite_nccl_comm_cfgs(cfgs, "tp", ("max_ctas", 8))
    assert cfgs == {"tp": {"is_high_priority_stream": True, "max_ctas": 8}}
    assert ps.get_nccl_options("dp", cfgs) is None  # no entry: NCCL's defaults
    with pytest.raises(MegatronCoreError, match=r"net_name \('carrier-pigeon'\)"):
        ps.get_nccl_options("ep", {"ep": {"net_name": "carrier-pigeon"}})
    if dist.is_nccl_available():
        options = ps.get_nccl_options("tp", cfgs)
        assert options.is_high_priority_stream and options.config.max_ctas == 8
    else:  # CPU-only torch: a clear error instead of an AttributeError deep in torch
        with pytest.raises(MegatronCoreError, match="need NCCL, which this torch build lacks"):
            ps.get_nccl_options("tp", cfgs)
