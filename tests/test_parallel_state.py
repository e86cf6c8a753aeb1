"""parallel_state on real gloo ranks: groups, getters, errors on every rank, re-initialization."""

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed

# (tp, pp, cp, ep, order) per world size; several configs share one set of worker processes.
CONFIGS = {
    4: [
        (2, 2, 1, 1, "tp-cp-ep-dp-pp"),
        (1, 2, 1, 2, "tp-cp-ep-dp-pp"),
        (1, 2, 1, 1, "tp-pp-dp"),
        (2, 1, 2, 1, "tp-cp-ep-dp-pp"),
    ],
    8: [(2, 2, 2, 1, "tp-cp-ep-dp-pp"), (2, 2, 1, 1, "tp-pp-dp"), (1, 4, 1, 2, "tp-cp-ep-dp-pp")],
}

GROUP_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "dp": ps.get_data_parallel_group,
    "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "cp": ps.get_context_parallel_group,
    "mp": ps.get_model_parallel_group,
    "tp-cp": ps.get_tensor_and_context_parallel_group,
    "ep": ps.get_expert_model_parallel_group,
    "tp-ep": ps.get_tensor_and_expert_parallel_group,
    "dp-modulo-ep": ps.get_data_modulo_expert_parallel_group,
    "embedding": ps.get_embedding_group,
    "position_embedding": ps.get_position_embedding_group,
}


def _observe() -> dict:
    """What this rank sees through the public getters and real collectives."""
    seen = {}
    for kind, get in GROUP_GETTERS.items():
        try:
            seen[kind] = dist.get_process_group_ranks(get())
        except MegatronCoreError as e:  # middle pipeline stages hold no embedding
            assert kind in ("embedding", "position_embedding"), e
            seen[kind] = None
    # A real collective over the TP group: the sum of its global ranks.
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    seen["tp_rank_sum"] = int(x.item())
    seen["scalars"] = (
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
        ps.get_tensor_model_parallel_src_rank(),
        ps.get_data_parallel_src_rank(),
        ps.get_pipeline_model_parallel_first_rank(),
        ps.get_pipeline_model_parallel_last_rank(),
        ps.get_pipeline_model_parallel_next_rank(),
        ps.get_pipeline_model_parallel_prev_rank(),
        ps.is_pipeline_first_stage(),
        ps.is_pipeline_last_stage(),
        ps.is_rank_in_embedding_group(),
        ps.is_rank_in_position_embedding_group(),
    )
    seen["gloo"] = dist.get_process_group_ranks(ps.get_data_parallel_group_gloo())
    return seen


def _body_layouts(configs):
    results = []
    for tp, pp, cp, ep, order in configs:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
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
    for i, (tp, pp, cp, ep, order) in enumerate(CONFIGS[world_size]):
        layout = ps.compute_rank_layout(world_size, tp, pp, cp, ep, order)
        for rank, results in enumerate(per_rank):
            seen = results[i]
            for kind in GROUP_GETTERS:
                assert seen[kind] == _group_of(layout, kind, rank), (kind, rank)
            tp_group = _group_of(layout, "tp", rank)
            pp_group = _group_of(layout, "pp", rank)
            dp_group = _group_of(layout, "dp", rank)
            emb = _group_of(layout, "embedding", rank)
            stage = pp_group.index(rank)
            expected = (
                tp_group.index(rank),
                tp,
                stage,
                pp,
                dp_group.index(rank),
                len(dp_group),
                _group_of(layout, "cp", rank).index(rank),
                cp,
                _group_of(layout, "ep", rank).index(rank),
                ep,
                tp_group[0],
                dp_group[0],
                pp_group[0],
                pp_group[-1],
                pp_group[(stage + 1) % pp],
                pp_group[(stage - 1) % pp],
                stage == 0,
                stage == pp - 1,
                emb is not None,
                _group_of(layout, "position_embedding", rank) is not None,
            )
            assert seen["scalars"] == expected, (order, rank)
            assert seen["tp_rank_sum"] == sum(tp_group)
            assert seen["gloo"] == dp_group


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
    expect(ps.initialize_model_parallel, order="tp-dp-dp")
    expect(ps.initialize_model_parallel, expert_model_parallel_size=3)
    expect(ps.initialize_model_parallel, virtual_pipeline_model_parallel_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    expect(ps.initialize_model_parallel)  # twice without destroy
    ps.destroy_model_parallel()
    # Everything still works after all those refusals: no rank is stuck in a collective.
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    x = torch.ones(1)
    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    messages.append(int(x.item()))
    return messages


def test_bad_input_raises_on_every_rank_without_hanging():
    world_size = 4
    for messages in run_distributed(_body_errors, world_size, world_size, timeout=120):
        assert "not initialized" in messages[0] and "not initialized" in messages[1]
        assert "tensor_model_parallel_size (3)" in messages[2] and "world size (4)" in messages[2]
        assert "tensor_model_parallel_size (0) must be an integer >= 1" in messages[3]
        assert "unknown token(s) ['foo']" in messages[4]
        assert "repeats token(s) ['dp']" in messages[5]
        assert (
            "expert_model_parallel_size (3) must divide the data-parallel size (4)" in (messages[6])
        )
        assert "virtual_pipeline_model_parallel_size (2)" in messages[7]
        assert "called twice" in messages[8]
        assert messages[9] == world_size


def test_initialize_without_torch_distributed_raises():
    assert not dist.is_initialized()
    with pytest.raises(MegatronCoreError, match="init_process_group"):
        ps.initialize_model_parallel()
    assert not ps.model_parallel_is_initialized()


def _body_virtual_pipeline():
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    seen = []
    for chunk in range(2):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        seen.append(
            (
                ps.get_virtual_pipeline_model_parallel_rank(),
                ps.is_pipeline_first_stage(),
                ps.is_pipeline_last_stage(),
                ps.is_pipeline_first_stage(ignore_virtual=True),
                ps.is_rank_in_embedding_group(),
                ps.is_rank_in_embedding_group(ignore_virtual=True),
            )
        )
    return seen


def test_virtual_pipeline_stages():
    rank0, rank1 = run_distributed(_body_virtual_pipeline, 2)
    # Stage 0 is "first" only on chunk 0; stage 1 is "last" only on the last chunk.
    assert rank0 == [(0, True, False, True, True, True), (1, False, False, True, False, True)]
    assert rank1 == [(0, False, False, False, False, True), (1, False, True, False, True, True)]


def _ranks_or_none(get):
    try:
        return dist.get_process_group_ranks(get())
    except MegatronCoreError:
        return None


def _body_more_getters():
    out = {}
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=4,
        pipeline_model_parallel_split_rank=2,
        create_gloo_process_groups=False,
    )
    out["split"] = ps.get_pipeline_model_parallel_split_rank()
    out["embedding"] = _ranks_or_none(ps.get_embedding_group)
    out["position"] = _ranks_or_none(ps.get_position_embedding_group)
    out["in_groups"] = (ps.is_rank_in_embedding_group(), ps.is_rank_in_position_embedding_group())
    try:
        ps.get_data_parallel_group_gloo()
        out["no_gloo"] = "NO ERROR"
    except MegatronCoreError as e:
        out["no_gloo"] = str(e)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    out["mp"] = (ps.get_model_parallel_rank(), ps.get_model_parallel_world_size())
    out["tp-cp"] = (
        ps.get_tensor_and_context_parallel_rank(),
        ps.get_tensor_and_context_parallel_world_size(),
    )
    out["dp-cp"] = (
        ps.get_data_parallel_rank(with_context_parallel=True),
        ps.get_data_parallel_world_size(with_context_parallel=True),
        ps.get_data_parallel_src_rank(with_context_parallel=True),
        dist.get_process_group_ranks(ps.get_data_parallel_group_gloo(with_context_parallel=True)),
    )
    out["cp_ranks"] = ps.get_context_parallel_global_ranks()
    ps.destroy_model_parallel()
    out["after_destroy"] = (
        ps.model_parallel_is_initialized(),
        ps.get_tensor_model_parallel_group(check_initialized=False),
    )
    return out


def test_split_rank_gloo_off_and_combined_getters_on_real_ranks():
    split = ps.compute_rank_layout(4, 1, 4, pipeline_model_parallel_split_rank=2)
    tpcp = ps.compute_rank_layout(4, 2, 1, 2)
    for rank, out in enumerate(run_distributed(_body_more_getters, 4, timeout=120)):
        emb = _group_of(split, "embedding", rank)
        pos = _group_of(split, "position_embedding", rank)
        assert out["split"] == 2
        assert (out["embedding"], out["position"]) == (emb, pos)
        assert emb in ([0, 2, 3], None) and pos in ([0, 2], None)
        assert out["in_groups"] == (emb is not None, pos is not None)
        assert "create_gloo_process_groups=False" in out["no_gloo"]
        mp, tp_cp = _group_of(tpcp, "mp", rank), _group_of(tpcp, "tp-cp", rank)
        dp_cp = _group_of(tpcp, "dp-cp", rank)
        assert out["mp"] == (mp.index(rank), len(mp))
        assert out["tp-cp"] == (tp_cp.index(rank), 4)
        assert out["dp-cp"] == (dp_cp.index(rank), 2, dp_cp[0], dp_cp)
        assert out["cp_ranks"] == _group_of(tpcp, "cp", rank)
        assert out["after_destroy"] == (False, None)


def test_unchecked_tensor_group_is_none_before_initialize():
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(MegatronCoreError, match="not initialized"):
        ps.get_tensor_model_parallel_group()


def _body_reinitialize_reuses_groups():
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_first = ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_again = ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)  # another layout: other groups
    tp_other = ps.get_tensor_model_parallel_group()
    x = torch.ones(1)
    dist.all_reduce(x, group=tp_again)  # the reused group still communicates
    return tp_again is tp_first, tp_other is tp_first, int(x.item())


def test_reinitialize_after_destroy_reuses_the_same_groups():
    # destroy_model_parallel drops the state but keeps the communicators (as megatron-core does);
    # the same layout gets the same ProcessGroup objects back instead of new gloo connections.
    for same, other, total in run_distributed(_body_reinitialize_reuses_groups, 4):
        assert (same, other, total) == (True, False, 2)
