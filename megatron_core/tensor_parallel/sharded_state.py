"""sharded_state_dict for the tensor-parallel layers: megatron-core's dist_checkpointing layout.

# NOTE [ Sharded state dict ]
megatron-core checkpoints a model as a "sharded state dict": every tensor is described as one
shard of a global tensor, so a checkpoint saved at one TP size loads at another. For the layers
of this package (megatron-core 0.16.1's semantics):
1. A TP-sharded tensor (ColumnParallelLinear weight and bias: axis 0; RowParallelLinear weight:
   axis 1; VocabParallelEmbedding weight: axis 0) is shard ``tp_rank`` of ``tp_size`` along that
   axis, replica id ``(0, 0, dp_rank)``: one copy per data-parallel rank, only dp rank 0 writes.
2. Any other tensor (RowParallelLinear bias, ...) is replicated over TP:
   replica id ``(0, tp_rank, dp_rank)``; only the (tp 0, dp 0) copy is written.
3. ``sharded_offsets`` — ``(axis, offset, count)`` triples given by the enclosing module (the
   layer number in a stack, the expert number) — prepend those axes to every tensor's global
   shape, in front of the TP axis.
4. ``_extra_state`` is a ShardedObject keyed like the tensor, shaped by the offsets' counts and
   placed at their offsets (``(1,)`` / ``(0,)`` without offsets), replica id
   ``(0, tp_rank, dp_rank)``.
5. The data-parallel group is ``metadata["dp_cp_group"]`` when given, else parallel_state's
   data-parallel group with context parallelism.
The types (ShardedTensor, ShardedObject) are megatron-core's own, imported when a method is
called: they are the [megatron] extra's. Without it, checkpoint with torch.distributed.checkpoint
(megatron_core.training's checkpoints) instead.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.errors import MegatronCoreError

__all__ = ["sharded_state_dict_of_layer"]


def _mapping_types():
    """megatron-core's ShardedTensor and ShardedObject, or a package error naming the extra."""
    try:
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    except ImportError as exc:
        raise MegatronCoreError(
            f"sharded_state_dict needs megatron-core's dist_checkpointing types, which are not "
            f"importable ({type(exc).__name__}: {exc}); install the [megatron] extra "
            f'(pip install "megatron-tp-core[megatron]"), or checkpoint with '
            f"torch.distributed.checkpoint (DCP) as megatron_core.training's checkpoints do"
        ) from exc
    return ShardedTensor, ShardedObject


def _rank(group) -> int:
    return 0 if group is None else group.rank()


def _size(group) -> int:
    return 1 if group is None else group.size()


def _dp_cp_group(metadata: dict | None):
    """NOTE [ Sharded state dict ], rule 5."""
    if metadata is not None and metadata.get("dp_cp_group") is not None:
        return metadata["dp_cp_group"]
    from megatron_core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _object_offsets(sharded_offsets) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """NOTE [ Sharded state dict ], rule 4: (global shape, offset) of an _extra_state object."""
    if not sharded_offsets:
        return (1,), (0,)
    ordered = sorted(sharded_offsets, key=lambda triple: triple[0])
    axes = [axis for axis, _, _ in ordered]
    if axes != list(range(len(axes))):
        raise MegatronCoreError(
            f"sharded_state_dict: sharded_offsets ({tuple(sharded_offsets)}) must cover the "
            f"leading axes 0..{len(axes) - 1} without gaps"
        )
    return tuple(count for _, _, count in ordered), tuple(offset for _, offset, _ in ordered)


def sharded_state_dict_of_layer(
    module: torch.nn.Module,
    prefix: str,
    tp_axes: dict[str, int],
    sharded_offsets=(),
    metadata: dict | None = None,
    allow_shape_mismatch: bool = False,
) -> dict[str, Any]:
    """The sharded state dict of one tensor-parallel layer (NOTE [ Sharded state dict ]).

    Args:
        module: the layer; its ``tp_group`` attribute is the group its tensors are split over.
        prefix: prepended to every key.
        tp_axes: state-dict name -> the axis it is split along over TP; others are replicated.
        sharded_offsets: ``(axis, offset, count)`` triples from the enclosing modules.
        metadata: megatron-core's metadata dict (``dp_cp_group``).
        allow_shape_mismatch: passed to the TP-sharded tensors (the embedding's, whose vocab may
            be padded differently at another TP size).

    Returns:
        ``{prefix + name: ShardedTensor | ShardedObject}`` for every state-dict entry.
    """
    sharded_tensor, sharded_object = _mapping_types()
    tp_group, dp_group = getattr(module, "tp_group", None), _dp_cp_group(metadata)
    tp_rank, tp_size, dp_rank = _rank(tp_group), _size(tp_group), _rank(dp_group)
    prepend = tuple(sharded_offsets)
    result = {}
    for name, value in module.state_dict(prefix="", keep_vars=True).items():
        key = f"{prefix}{name}"
        if name.endswith("_extra_state"):  # rule 4
            shape, offset = _object_offsets(prepend)
            result[key] = sharded_object(key, value, shape, offset, (0, tp_rank, dp_rank))
        elif name in tp_axes:  # rule 1
            result[key] = sharded_tensor.from_rank_offsets(
                key,
                value,
                *prepend,
                (tp_axes[name] + len(prepend), tp_rank, tp_size),
                replica_id=(0, 0, dp_rank),
                prepend_axis_num=len(prepend),
                **({"allow_shape_mismatch": True} if allow_shape_mismatch else {}),
            )
        else:  # rule 2
            result[key] = sharded_tensor.from_rank_offsets(
                key,
                value,
                *prepend,
                replica_id=(0, tp_rank, dp_rank),
                prepend_axis_num=len(prepend),
            )
    return result
