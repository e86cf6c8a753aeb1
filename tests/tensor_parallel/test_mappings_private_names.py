"""tensor_parallel.mappings under megatron-core's private class names, each with ``symbolic``
(NOTE [ megatron-core's private names ] in mappings.py)."""

import ast

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.tensor_parallel import mappings
from megatron_core.testing import run_distributed

MEGATRON_NAMES = [
    "_CopyToModelParallelRegion",
    "_ReduceFromModelParallelRegion",
    "_ScatterToModelParallelRegion",
    "_GatherFromModelParallelRegion",
    "_ScatterToSequenceParallelRegion",
    "_GatherFromSequenceParallelRegion",
    "_ReduceScatterToSequenceParallelRegion",
    "_AllGatherFromTensorParallelRegion",
    "_ReduceScatterToTensorParallelRegion",
]


def test_megatron_names_are_region_classes_with_symbolic():
    for name in MEGATRON_NAMES:
        region = getattr(mappings, name)
        assert issubclass(region, torch.autograd.Function), name
        assert callable(region.symbolic), name
    assert issubclass(mappings._AllToAll, torch.autograd.Function)


@pytest.mark.requires_megatron_core
def test_every_autograd_class_name_of_megatron_core_exists():
    # Read with ast, found through the package metadata: importing megatron-core's module (or
    # find_spec, which imports its parent packages) would import megatron-core's parallel_state
    # into this process, where a later install() of the switch is refused.
    import importlib.metadata

    dist_info = importlib.metadata.distribution("megatron-core")
    path = dist_info.locate_file("megatron/core/tensor_parallel/mappings.py")
    tree = ast.parse(open(path).read())
    theirs = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert theirs == set(MEGATRON_NAMES) | {"_AllToAll"}


def _body() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank()
    x = torch.arange(8.0).reshape(4, 2) + 10 * rank
    region = {
        "copy": mappings.copy_to_tensor_model_parallel_region,
        "reduce": mappings.reduce_from_tensor_model_parallel_region,
        "scatter": mappings.scatter_to_tensor_model_parallel_region,
        "gather": mappings.gather_from_tensor_model_parallel_region,
        "scatter_seq": mappings.scatter_to_sequence_parallel_region,
        "gather_seq": mappings.gather_from_sequence_parallel_region,
        "reduce_scatter_seq": mappings.reduce_scatter_to_sequence_parallel_region,
        "all_gather_last": mappings.all_gather_last_dim_from_tensor_parallel_region,
        "reduce_scatter_last": mappings.reduce_scatter_last_dim_to_tensor_parallel_region,
    }
    same = {}
    for (key, function), name in zip(region.items(), MEGATRON_NAMES):
        by_symbolic = getattr(mappings, name).symbolic(None, x, group)
        same[key] = torch.equal(by_symbolic, function(x, group=group))
    return same


def test_symbolic_returns_the_forward_result():
    for same in run_distributed(_body, 2):
        assert all(same.values()), same
