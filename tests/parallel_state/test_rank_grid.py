"""Rank layout, single process: compute_rank_layout and RankGenerator against megatron-core 0.16.

Two independent checks: tables written out by hand from megatron-core 0.16's rules (its docstring
examples, the issue's expert-grid cases, worlds 1, 2, 4 and 8), and a brute-force reference that
groups ranks by their grid coordinates instead of the prefix-product algorithm the library uses.
"""

import math

import pytest
import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state import (
    RankGenerator,
    compute_rank_layout,
    generate_masked_orthogonal_rank_groups,
)
from megatron_core.parallel_state.rank_generator import (
    hierarchical_rank_groups,
    hybrid_dp_cp_rank_groups,
)

# kind -> (grid, axes that vary inside a group); NOTE [ Rank layout ], rule 4.
KIND_AXES = {
    "tp": ("dense", {"tp"}),
    "pp": ("dense", {"pp"}),
    "dp": ("dense", {"dp"}),
    "dp-cp": ("dense", {"dp", "cp"}),
    "cp": ("dense", {"cp"}),
    "mp": ("dense", {"tp", "pp"}),
    "tp-cp": ("dense", {"tp", "cp"}),
    "tp-dp": ("dense", {"tp", "dp"}),
    "tp-dp-cp": ("dense", {"tp", "dp", "cp"}),
    "ep": ("expert", {"ep"}),
    "expt-tp": ("expert", {"tp"}),
    "tp-ep": ("expert", {"tp", "ep"}),
    "tp-ep-pp": ("expert", {"tp", "ep", "pp"}),
    "expt-dp": ("expert", {"dp"}),
}


def brute_force_groups(world, sizes, order, vary):
    """Group ranks that agree on every coordinate outside `vary` (coordinates: mixed radix)."""
    tokens = order.split("-") + [a for a in ("tp", "pp", "dp", "ep", "cp") if a not in order]
    assert math.prod(sizes[t] for t in tokens) == world
    groups = {}
    for r in range(world):
        stride, key = 1, []
        for name in tokens:
            if name not in vary:
                key.append((r // stride) % sizes[name])
            stride *= sizes[name]
        groups.setdefault(tuple(key), []).append(r)
    return sorted(sorted(g) for g in groups.values())


CONFIGS = [
    # world, tp, pp, cp, ep, etp, order
    (8, 2, 2, 1, 1, None, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 2, 1, None, "tp-cp-ep-dp-pp"),
    (8, 1, 2, 1, 2, None, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 2, 1, None, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 1, None, "tp-pp-dp"),
    (8, 1, 1, 2, 2, None, "tp-cp-ep-dp-pp"),
    (8, 1, 1, 4, 4, None, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 2, 4, 1, "tp-cp-ep-dp-pp"),
    (6, 3, 1, 1, 1, None, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 2, 2, None, "tp-cp-ep-dp-pp"),
    (16, 1, 2, 2, 2, None, "tp-cp-dp-ep-pp"),
    (16, 4, 2, 1, 4, 2, "tp-dp-ep-cp-pp"),
]


@pytest.mark.parametrize("world,tp,pp,cp,ep,etp,order", CONFIGS)
def test_every_kind_matches_brute_force(world, tp, pp, cp, ep, etp, order):
    layout = compute_rank_layout(world, tp, pp, cp, ep, order, expert_tensor_parallel_size=etp)
    etp = tp if etp is None else etp
    sizes = {
        "dense": {"tp": tp, "pp": pp, "cp": cp, "ep": 1, "dp": world // (tp * pp * cp)},
        "expert": {"tp": etp, "pp": pp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp)},
    }
    for kind, (grid, vary) in KIND_AXES.items():
        assert sorted(layout[kind]) == brute_force_groups(world, sizes[grid], order, vary), kind
        # Every rank is in exactly one group of each kind.
        assert sorted(r for g in layout[kind] for r in g) == list(range(world)), kind


def singletons(n):
    return [[r] for r in range(n)]


# Hand-written from megatron-core 0.16's rules: (world, kwargs) -> expected groups per kind.
TABLES = [
    (1, {}, {k: [[0]] for k in KIND_AXES}),
    (
        2,
        dict(tensor_model_parallel_size=2),
        {
            "tp": [[0, 1]],
            "dp": singletons(2),
            "ep": singletons(2),
            "expt-tp": [[0, 1]],
            "expt-dp": singletons(2),
            "tp-ep": [[0, 1]],
        },
    ),
    (
        2,
        dict(context_parallel_size=2, expert_model_parallel_size=2),
        {
            "cp": [[0, 1]],
            "dp": singletons(2),
            "dp-cp": [[0, 1]],
            "ep": [[0, 1]],
            "expt-dp": singletons(2),
        },
    ),
    (
        4,
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
        {
            "dp": [[0, 2], [1, 3]],
            "expt-tp": [[0, 1], [2, 3]],
            "ep": [[0, 2], [1, 3]],
            "tp-ep": [[0, 1, 2, 3]],
            "expt-dp": singletons(4),
        },
    ),
    (
        4,
        dict(
            tensor_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
        {
            "tp": [[0, 1], [2, 3]],
            "expt-tp": singletons(4),
            "ep": [[0, 1], [2, 3]],
            "tp-ep": [[0, 1], [2, 3]],
            "expt-dp": [[0, 2], [1, 3]],
        },
    ),
    (
        4,
        dict(context_parallel_size=2, expert_model_parallel_size=2),
        {
            "cp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "dp-cp": [[0, 1, 2, 3]],
            "ep": [[0, 1], [2, 3]],
            "expt-dp": [[0, 2], [1, 3]],
        },
    ),
    (
        4,
        dict(context_parallel_size=4, expert_model_parallel_size=4),
        {
            "cp": [[0, 1, 2, 3]],
            "dp": singletons(4),
            "ep": [[0, 1, 2, 3]],
            "expt-dp": singletons(4),
        },
    ),
    (
        4,
        dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
        {
            "dp": [[0, 1], [2, 3]],
            "pp": [[0, 2], [1, 3]],
            "ep": [[0, 1], [2, 3]],
            "expt-dp": singletons(4),
            "tp-ep-pp": [[0, 1, 2, 3]],
        },
    ),
    # The case: megatron-core 0.16 gives ep [[0,1],[2,3],[4,5],[6,7]].
    (
        8,
        dict(context_parallel_size=2, expert_model_parallel_size=2),
        {
            "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "expt-dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
    ),
    # Refused before (ep had to divide dp = 2); megatron-core 0.16 accepts it.
    (
        8,
        dict(context_parallel_size=4, expert_model_parallel_size=4),
        {
            "cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp-cp": [list(range(8))],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "expt-dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        8,
        dict(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "expt-tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "tp-ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "expt-dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        8,
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
        {
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "expt-dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "tp-ep-pp": [[0, 1, 4, 5], [2, 3, 6, 7]],
        },
    ),
    # Two distributed-optimizer instances (NOTE [ Rank layout ], rule 7).
    (
        8,
        dict(tensor_model_parallel_size=2, num_distributed_optimizer_instances=2),
        {
            "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "intra-dp-cp": [[0, 2], [4, 6], [1, 3], [5, 7]],
            "intra-expt-dp": [[0, 2], [4, 6], [1, 3], [5, 7]],
            "inter-dist-opt": [[0, 4], [2, 6], [1, 5], [3, 7]],
            "intra-dist-opt": [[0, 1, 2, 3], [4, 5, 6, 7]],
        },
    ),
    (
        8,
        dict(tensor_model_parallel_size=2),
        {
            "intra-dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "intra-dist-opt": [list(range(8))],
        },
    ),
]


@pytest.mark.parametrize("world,kwargs,expected", TABLES)
def test_hand_written_layouts(world, kwargs, expected):
    layout = compute_rank_layout(world, **kwargs)
    for kind, groups in expected.items():
        assert layout[kind] == groups, kind
    assert layout["dp-modulo-ep"] == layout["expt-dp"]
    assert ("inter-dist-opt" in layout) == (
        kwargs.get("num_distributed_optimizer_instances", 1) > 1
    )


def test_megatron_docstring_example_16_ranks_tp2_pp4():
    # megatron-core's initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4.
    layout = compute_rank_layout(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert layout["position_embedding"] == [[0], [1], [2], [3]]


def test_worked_examples_of_the_note():
    layout = compute_rank_layout(8, 2, 2)
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    gen = RankGenerator(tp=1, ep=2, dp=4, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_rank_generator_api():
    gen = RankGenerator(tp=2, ep=1, dp=3, pp=1, cp=1, order="TP-DP", rank_offset=10)
    assert gen.order == "tp-dp-pp-ep-cp" and gen.ordered_size == [2, 3, 1, 1, 1]
    assert gen.world_size == 6
    assert gen.get_mask(gen.order, "dp-tp") == [True, True, False, False, False]
    assert gen.get_ranks("dp") == [[10, 12, 14], [11, 13, 15]]
    # megatron-core's docstring example of generate_masked_orthogonal_rank_groups.
    groups = generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]
    with pytest.raises(MegatronCoreError, match=r"ep \(2\) and cp \(2\)"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(MegatronCoreError, match=r"names axes \['zz'\]"):
        gen.get_ranks("tp-zz")


def test_hierarchical_and_hybrid_groups():
    # megatron-core's create_hierarchical_groups docstring: 16 ranks, sizes [2, 2, 4].
    levels = hierarchical_rank_groups(list(range(16)), [2, 2, 4])
    assert levels[0] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert levels[1][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert levels[2] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    layout = compute_rank_layout(
        8,
        context_parallel_size=8,
        hierarchical_context_parallel_sizes=[2, 4],
        hybrid_context_parallel=True,
    )
    assert layout["hcp-0"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["hcp-1"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["hybrid-dp-cp-2"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["hybrid-dp-cp-4"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "hybrid-dp-cp-8" not in layout  # the whole dp-cp group serves that size
    assert hybrid_dp_cp_rank_groups([5, 7]) == {}


def test_embedding_rules_split_rank_and_custom():
    layout = compute_rank_layout(8, 1, 4, pipeline_model_parallel_split_rank=1)
    assert layout["embedding"] == [[0, 2, 6], [1, 3, 7]]
    assert layout["position_embedding"] == [[0, 2], [1, 3]]
    layout = compute_rank_layout(8, 1, 4, get_embedding_ranks=lambda p: p[1:3])
    assert layout["embedding"] == [[2, 4], [3, 5]]
    assert compute_rank_layout(2, 1, 1)["embedding"] == [[0], [1]]  # one stage


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tensor_model_parallel_size=3), r"= 3 must divide world size \(8\)"),
        (dict(tensor_model_parallel_size=0), r"tensor_model_parallel_size \(0\) must be"),
        (dict(pipeline_model_parallel_size=-1), r"pipeline_model_parallel_size \(-1\)"),
        (dict(context_parallel_size=1.5), r"context_parallel_size \(1.5\)"),
        (
            dict(expert_model_parallel_size=3),
            r"\(3\) x pipeline_model_parallel_size \(1\) = 3 must",
        ),
        (dict(tensor_model_parallel_size=2, expert_model_parallel_size=8), r"= 16 must divide"),
        (dict(expert_tensor_parallel_size=0), r"expert_tensor_parallel_size \(0\)"),
        (dict(num_distributed_optimizer_instances=3), r"instances \(3\) must divide"),
        (dict(order="tp-xx-dp"), r"unknown token\(s\) \['xx'\]"),
        (dict(order="tp-dp-tp-pp"), r"repeats token\(s\) \['tp'\]"),
        (dict(order="tp-dp", pipeline_model_parallel_size=2), r"omits 'pp' but its size is 2"),
        (
            dict(order="tp-ep-pp-dp", pipeline_model_parallel_size=2, expert_model_parallel_size=2),
            r"expert data parallel size \(2\) must equal the data parallel size \(4\)",
        ),
        (
            dict(
                order="tp-pp-ep-dp",
                tensor_model_parallel_size=2,
                pipeline_model_parallel_size=2,
                expert_model_parallel_size=2,
                expert_tensor_parallel_size=1,
            ),
            r"pipeline groups differ between the dense grid",
        ),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=2),
            r"pipeline_model_parallel_split_rank \(2\)",
        ),
        (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3]), r"\[2, 3\]"),
        (dict(get_embedding_ranks=lambda p: [99]), r"returned \[99\]"),
    ],
)
def test_bad_input_raises_named_error(kwargs, message):
    with pytest.raises(MegatronCoreError, match=message):
        compute_rank_layout(8, **kwargs)


def reshape_reference(world, axes, vary):
    """Groups by torch reshaping (an algorithm independent of the library's mixed-radix one).

    ``axes`` lists (name, size) fastest-varying first. The rank tensor is shaped slowest-first;
    the varying axes are moved last and flattened into one row per group.
    """
    names = [n for n, _ in reversed(axes)]
    ranks = torch.arange(world).reshape([s for _, s in reversed(axes)])
    fixed = [i for i, n in enumerate(names) if n not in vary]
    moving = [i for i, n in enumerate(names) if n in vary]
    size = math.prod(ranks.shape[i] for i in moving)
    return ranks.permute(fixed + moving).reshape(-1, size).tolist()


# megatron-core's own unit tests check its RankGenerator against older, loop-based code at these
# (nodes, gpus per node, tp, pp, cp, ep) settings; here the reference is reshape_reference.
LARGE = [
    (1, 8, 8, 1, 1, 1),
    (3, 8, 8, 3, 1, 1),
    (8, 8, 2, 2, 2, 4),
    (8, 8, 2, 1, 4, 8),
    (16, 8, 4, 8, 4, 1),
    (64, 8, 4, 2, 8, 8),
    (316, 8, 4, 8, 1, 1),
]


@pytest.mark.parametrize("nodes,gpus,tp,pp,cp,ep", LARGE)
def test_large_worlds_match_reshape_reference(nodes, gpus, tp, pp, cp, ep):
    world = nodes * gpus
    dp, expert_dp = world // (tp * pp * cp), world // (tp * ep * pp)
    layout = compute_rank_layout(world, tp, pp, cp, ep)
    dense = [("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)]
    expert = [("tp", tp), ("ep", ep), ("dp", expert_dp), ("pp", pp)]
    for kind, (grid, vary) in KIND_AXES.items():
        axes = dense if grid == "dense" else expert
        assert layout[kind] == reshape_reference(world, axes, vary), kind


def test_orders_that_only_move_size_one_axes_agree():
    # megatron-core's "different initialize order consistency" cases on 8 ranks.
    for tp, pp, ep in [(1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1), (4, 1, 2), (1, 1, 8), (2, 1, 4)]:
        a = compute_rank_layout(8, tp, pp, 1, ep, "tp-ep-dp-pp")
        b = compute_rank_layout(8, tp, pp, 1, ep, "tp-pp-ep-dp")
        for kind in ("tp", "dp", "pp", "cp", "mp", "tp-dp", "tp-ep", "expt-dp"):
            assert a[kind] == b[kind], (tp, pp, ep, kind)
