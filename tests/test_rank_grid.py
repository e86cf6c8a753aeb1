"""Rank layout, single process: compute_rank_layout against megatron-core's documented layout.

Two independent checks: literal layouts written out by hand (megatron-core's docstring example and
the configs the foundation issue lists), and a brute-force reference that groups ranks by their
grid coordinates instead of the prefix-product algorithm the library uses.
"""

import math

import pytest

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state import compute_rank_layout
from megatron_core.rank_grid import RankGrid, embedding_ranks

# kind -> axes that vary inside a group, and whether the expert axis is split out of dp.
KIND_AXES = {
    "tp": ({"tp"}, False),
    "pp": ({"pp"}, False),
    "dp": ({"dp"}, False),
    "dp-cp": ({"dp", "cp"}, False),
    "cp": ({"cp"}, False),
    "mp": ({"tp", "pp"}, False),
    "tp-cp": ({"tp", "cp"}, False),
    "tp-dp": ({"tp", "dp"}, False),
    "tp-dp-cp": ({"tp", "dp", "cp"}, False),
    "ep": ({"ep"}, True),
    "tp-ep": ({"tp", "ep"}, True),
    "dp-modulo-ep": ({"dp"}, True),
    "dp-cp-modulo-ep": ({"dp", "cp"}, True),
}


def brute_force_groups(world, sizes, order, vary, with_ep):
    """Group ranks that agree on every coordinate outside `vary` (coordinates: mixed radix)."""
    tokens = order.split("-") + [a for a in ("tp", "pp", "dp", "ep", "cp") if a not in order]
    axes = []
    for t in tokens:
        if t == "ep" and not with_ep:
            continue
        size = sizes[t] // sizes["ep"] if (t == "dp" and with_ep) else sizes[t]
        axes.append((t, size))
    assert math.prod(s for _, s in axes) == world
    groups = {}
    for r in range(world):
        stride, key = 1, []
        for name, size in axes:
            if name not in vary:
                key.append((r // stride) % size)
            stride *= size
        groups.setdefault(tuple(key), []).append(r)
    return sorted(sorted(g) for g in groups.values())


CONFIGS = [
    # world, tp, pp, cp, ep, order
    (8, 2, 2, 1, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (8, 4, 2, 1, 1, "tp-cp-ep-dp-pp"),
    (8, 1, 2, 1, 2, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 2, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 1, "tp-pp-dp"),
    (8, 1, 4, 1, 1, "tp-cp-ep-dp-pp"),
    (6, 3, 1, 1, 1, "tp-cp-ep-dp-pp"),
    (16, 2, 4, 1, 1, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 1, 2, "tp-cp-ep-dp-pp"),
    (16, 1, 2, 2, 2, "tp-cp-dp-ep-pp"),
    (8, 1, 1, 1, 8, "tp-cp-ep-dp-pp"),
]


@pytest.mark.parametrize("world,tp,pp,cp,ep,order", CONFIGS)
def test_every_kind_matches_brute_force(world, tp, pp, cp, ep, order):
    layout = compute_rank_layout(world, tp, pp, cp, ep, order)
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp": world // (tp * pp * cp)}
    for kind, (vary, with_ep) in KIND_AXES.items():
        expected = brute_force_groups(world, sizes, order, vary, with_ep)
        assert sorted(layout[kind]) == expected, kind
        # Every rank is in exactly one group of each kind.
        assert sorted(r for g in layout[kind] for r in g) == list(range(world)), kind


def test_megatron_docstring_example_16_ranks_tp2_pp4():
    # megatron-core's initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4.
    layout = compute_rank_layout(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_worked_example_8_ranks_tp2_pp2():
    # The example in NOTE [ Rank layout ] and initialize_model_parallel's docstring.
    layout = compute_rank_layout(8, 2, 2)
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["position_embedding"] == [[0], [1], [2], [3]]


def test_literal_layouts_of_issue_configs():
    tp2cp2 = compute_rank_layout(8, 2, 1, 2)
    assert tp2cp2["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tp2cp2["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp2cp2["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert tp2cp2["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    tp4pp2 = compute_rank_layout(8, 4, 2)
    assert tp4pp2["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tp4pp2["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp4pp2["dp"] == [[r] for r in range(8)]

    pp2ep2 = compute_rank_layout(8, 1, 2, 1, 2)
    assert pp2ep2["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pp2ep2["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp2ep2["dp-modulo-ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp2ep2["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]

    tp2pp2cp2 = compute_rank_layout(8, 2, 2, 2)
    assert tp2pp2cp2["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tp2pp2cp2["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp2pp2cp2["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert tp2pp2cp2["dp"] == [[r] for r in range(8)]

    tp_pp_dp = compute_rank_layout(8, 2, 2, order="tp-pp-dp")
    assert tp_pp_dp["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tp_pp_dp["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp_pp_dp["mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    pp4 = compute_rank_layout(8, 1, 4)
    assert pp4["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert pp4["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp4["embedding"] == [[0, 6], [1, 7]]
    assert pp4["position_embedding"] == [[0], [1]]

    tp3 = compute_rank_layout(6, 3)
    assert tp3["tp"] == [[0, 1, 2], [3, 4, 5]]
    assert tp3["dp"] == [[0, 3], [1, 4], [2, 5]]


def test_embedding_groups_with_split_rank():
    assert embedding_ranks([0, 2, 4, 6], split_rank=2) == ([0, 4, 6], [0, 4])
    assert embedding_ranks([0, 2, 4, 6], split_rank=None) == ([0, 6], [0])
    assert embedding_ranks([3], split_rank=0) == ([3], [3])
    layout = compute_rank_layout(8, 1, 4, pipeline_model_parallel_split_rank=1)
    assert layout["embedding"] == [[0, 2, 6], [1, 3, 7]]
    assert layout["position_embedding"] == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tensor_model_parallel_size=3), r"= 3 must divide world size \(8\)"),
        (dict(tensor_model_parallel_size=0), r"tensor_model_parallel_size \(0\) must be"),
        (dict(pipeline_model_parallel_size=-1), r"pipeline_model_parallel_size \(-1\)"),
        (dict(context_parallel_size=1.5), r"context_parallel_size \(1.5\)"),
        (dict(expert_model_parallel_size=3), r"expert_model_parallel_size \(3\) must divide"),
        (dict(order="tp-xx-dp"), r"unknown token\(s\) \['xx'\]"),
        (dict(order="tp-dp-tp-pp"), r"repeats token\(s\) \['tp'\]"),
        (dict(order="tp-ep-cp-dp-pp"), r"'ep' and 'dp' next to each other"),
        (dict(order="tp-dp", pipeline_model_parallel_size=2), r"omits 'pp' but its size is 2"),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=2),
            r"pipeline_model_parallel_split_rank \(2\)",
        ),
    ],
)
def test_bad_input_raises_named_error(kwargs, message):
    with pytest.raises(MegatronCoreError, match=message):
        compute_rank_layout(8, **kwargs)


def test_rank_grid_rejects_unknown_kind():
    with pytest.raises(MegatronCoreError, match=r"names axes \['zz'\]"):
        RankGrid(tp=2, dp=2).ranks("tp-zz")
