"""Rank bodies for tests/megatron/test_megatron_sharded_state.py."""

from __future__ import annotations

import sys

import torch

from megatron_core import megatron as switch


def _layers():
    from megatron_core import ModelParallelConfig, tensor_parallel

    config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    init = torch.nn.init.ones_
    column = tensor_parallel.ColumnParallelLinear(
        8, 6, config=config, init_method=init, bias=True, gather_output=False
    )
    row = tensor_parallel.RowParallelLinear(
        6, 8, config=config, init_method=init, bias=True, input_is_parallel=True,
        skip_bias_add=False,
    )  # fmt: skip
    embedding = tensor_parallel.VocabParallelEmbedding(16, 8, init_method=init, config=config)
    return column, row, embedding


def _describe(entry) -> dict:
    fields = ("key", "global_shape", "global_offset", "axis_fragmentations", "replica_id")
    out = {f: getattr(entry, f) for f in fields if hasattr(entry, f)}
    out["type"] = type(entry).__name__
    for flag in ("prepend_axis_num", "allow_shape_mismatch"):
        if hasattr(entry, flag):
            out[flag] = getattr(entry, flag)
    return out


def sharded_layout() -> dict:
    """Descriptions of each layer's sharded state dict at tp = 2, with and without offsets."""
    switch.install()
    from megatron_core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    column, row, embedding = _layers()
    result = {}
    for prefix, layer in (("col.", column), ("row.", row), ("emb.", embedding)):
        for key, entry in layer.sharded_state_dict(prefix).items():
            result[key] = _describe(entry)
        offsets = ((0, 1, 3),)  # layer 1 of a stack of 3
        for key, entry in layer.sharded_state_dict(prefix, sharded_offsets=offsets).items():
            result["stacked." + key] = _describe(entry)
    return result


def error_without_megatron() -> str:
    """The error sharded_state_dict raises when megatron-core's types cannot be imported."""
    from megatron_core import parallel_state
    from megatron_core.errors import MegatronCoreError

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    column, _, _ = _layers()
    name = "megatron.core.dist_checkpointing.mapping"
    saved = sys.modules.get(name)
    sys.modules[name] = None  # what an environment without the extra sees: ImportError
    try:
        column.sharded_state_dict()
    except MegatronCoreError as exc:
        return str(exc)
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved
    return "no error"
