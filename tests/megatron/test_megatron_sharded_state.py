"""sharded_state_dict of the tensor-parallel layers: megatron-core 0.16.1's layout (tp = 2).

NOTE [ Sharded state dict ] in megatron_core/tensor_parallel/sharded_state.py states the rules;
this checks each one on the ShardedTensor / ShardedObject fields megatron-core's
dist_checkpointing reads. tests/megatron/test_megatron_checkpoint.py round-trips a whole GPTModel.
"""

import pytest
from _megatron_sharded_checks import error_without_megatron, sharded_layout

from megatron_core.testing import run_distributed

TIMEOUT = 240


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(sharded_layout, 2, timeout=TIMEOUT)


@pytest.mark.requires_megatron_core
@pytest.mark.parametrize(
    "key, global_shape, axis_fragmentations",
    [
        ("col.weight", (6, 8), (2, 1)),  # rule 1: column weight and bias split on axis 0
        ("col.bias", (6,), (2,)),
        ("row.weight", (8, 6), (1, 2)),  # rule 1: row weight split on axis 1
        ("row.bias", (8,), (1,)),  # rule 2: replicated
        ("emb.weight", (16, 8), (2, 1)),  # rule 1: vocab split on axis 0
        ("stacked.col.weight", (3, 6, 8), (3, 2, 1)),  # rule 3: the stack axis in front
        ("stacked.row.bias", (3, 8), (3, 1)),
    ],
)
def test_sharded_tensors(layouts, key, global_shape, axis_fragmentations):
    for tp_rank, layout in enumerate(layouts):
        entry = layout[key]
        assert entry["type"] == "ShardedTensor"
        assert entry["key"] == key.removeprefix("stacked.")
        assert tuple(entry["global_shape"]) == global_shape
        assert tuple(entry["axis_fragmentations"]) == axis_fragmentations
        sharded_axes = [i for i, n in enumerate(axis_fragmentations) if n == 2]
        offset = [0] * len(global_shape)
        if key.startswith("stacked."):
            offset[0] = 1
        for axis in sharded_axes:
            offset[axis] = tp_rank * global_shape[axis] // 2
        assert tuple(entry["global_offset"]) == tuple(offset)
        replicated = not sharded_axes
        assert entry["replica_id"] == (0, tp_rank if replicated else 0, 0)
    assert layouts[0]["emb.weight"]["allow_shape_mismatch"] is True


@pytest.mark.requires_megatron_core
@pytest.mark.parametrize(
    "key, global_shape, global_offset",
    [("col._extra_state", (1,), (0,)), ("stacked.row._extra_state", (3,), (1,))],
)
def test_extra_state_is_an_object(layouts, key, global_shape, global_offset):
    for tp_rank, layout in enumerate(layouts):  # rule 4
        entry = layout[key]
        assert entry["type"] == "ShardedObject"
        assert tuple(entry["global_shape"]) == global_shape
        assert tuple(entry["global_offset"]) == global_offset
        assert entry["replica_id"] == (0, tp_rank, 0)


def test_without_megatron_core_the_error_names_the_extra():
    message = run_distributed(error_without_megatron, 2, timeout=TIMEOUT)[0]
    assert "[megatron]" in message and "torch.distributed.checkpoint" in message, message
