"""Tensor helpers of ``megatron_core.utils`` (re-exported there).

Viewless tensors, the deferred embedding weight-gradient of pipeline drains, and sharded tensors
for megatron-core's ``dist_checkpointing`` (optional: the ``[megatron]`` extra).

# NOTE [ Viewless tensors ]
1. A view keeps its base alive through ``._base``: replacing ``view.data`` later (as pipeline
   schedules do to free an output they sent) frees nothing, because the base still holds the
   memory. ``make_viewless_tensor`` returns a tensor over the same storage, offset, size and
   stride whose ``._base`` is None, so that ``.data`` replacement really releases it.
2. ``keep_graph=True`` returns it from an identity autograd function (the gradient flows to the
   view); ``keep_graph=False`` returns a new leaf with ``requires_grad`` as asked.
3. A tensor that is not a view is returned unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import consistency, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.utils.groups import get_pg_rank, get_pg_size

try:  # apex's fused weight-gradient GEMMs; optional, never a dependency
    import fused_weight_gradient_mlp_cuda as _apex_wgrad
except ImportError:
    _apex_wgrad = None

__all__ = [
    "make_viewless_tensor",
    "assert_viewless_tensor",
    "safely_set_viewless_tensor_data",
    "prepare_input_tensors_for_wgrad_compute",
    "drain_embedding_wgrad_compute",
    "make_tp_sharded_tensor_for_checkpoint",
    "make_sharded_tensor_for_checkpoint",
]


def _viewless(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A base-less tensor over ``inp``'s memory (NOTE [ Viewless tensors ], rule 1)."""
    out = torch.empty(0, dtype=inp.dtype, device=inp.device)
    with torch.no_grad():
        out.set_(inp.untyped_storage(), inp.storage_offset(), inp.size(), inp.stride())
    return out.requires_grad_(requires_grad)


class _MakeViewless(torch.autograd.Function):
    """Identity forward (into a base-less tensor) and identity backward; rule 2."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        return _viewless(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool):
    """``inp`` as a tensor without ``._base`` (same memory); see NOTE [ Viewless tensors ].

    Args:
        inp: any tensor; returned unchanged when it is not a view.
        requires_grad: ``requires_grad`` of the new tensor.
        keep_graph: stay in the autograd graph (gradients reach ``inp``) instead of returning a
            new leaf.
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return _MakeViewless.apply(inp, requires_grad)
    return _viewless(inp, requires_grad)


def assert_viewless_tensor(tensor, extra_msg: str | None = None):
    """Return ``tensor`` (or each tensor of a list) after checking it is not a view.

    Non-tensors pass through unchecked.

    Raises:
        MegatronCoreError: a tensor has ``._base`` set (storing it would keep its base alive).
    """
    if isinstance(tensor, list):
        for item in tensor:
            assert_viewless_tensor(item, extra_msg)
        return tensor
    if isinstance(tensor, torch.Tensor) and tensor._base is not None:
        raise MegatronCoreError(
            f"tensor of shape {tuple(tensor.shape)} is a view of a tensor of shape "
            f"{tuple(tensor._base.shape)}: make it viewless before setting .data or storing it "
            f"(else its base is never freed). {extra_msg or ''}".rstrip()
        )
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    """``tensor.data = new_data_tensor``, after checking ``tensor`` is not a view.

    Raises:
        MegatronCoreError: ``tensor`` is a view (names both shapes).
    """
    assert_viewless_tensor(
        tensor, extra_msg=f"new_data_tensor has shape {tuple(new_data_tensor.shape)}."
    )
    tensor.data = new_data_tensor


def prepare_input_tensors_for_wgrad_compute(grad_output, all_gathered_input):
    """Contiguous ``(grad_output, all_gathered_input)``, 3-D ``[s, b, h]`` flattened to 2-D.

    Returns:
        ``grad_output`` [s*b, h_out] and ``all_gathered_input`` [s*b, h_in] when ``grad_output``
        is 3-D; otherwise both contiguous with their shapes unchanged.
    """
    grad_output = grad_output.contiguous()
    all_gathered_input = all_gathered_input.contiguous()
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[2])
        all_gathered_input = all_gathered_input.view(-1, all_gathered_input.shape[2])
    return grad_output, all_gathered_input


def _all_gather_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``input_`` of ``group`` concatenated along dim 0, in rank order."""
    consistency.check_collective("all_gather", group, input_)
    input_ = input_.contiguous()
    parts = [torch.empty_like(input_) for _ in range(dist.get_world_size(group))]
    with consistency.named_failures("all_gather", group):
        dist.all_gather(parts, input_, group=group)
    return torch.cat(parts, dim=0)


def _accumulate_wgrad(grad_output, total_input, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (2-D): apex's fused GEMM on cuda when it
    imports, else torch in main_grad's dtype (tensor_parallel's linear backward does the same)."""
    if main_grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise MegatronCoreError(
            f"drain_embedding_wgrad_compute: main_grad dtype {main_grad.dtype} is not "
            f"float32, float16 or bfloat16"
        )
    if _apex_wgrad is not None and total_input.device.type == "cuda":
        fp32 = main_grad.dtype == torch.float32
        kernel = _apex_wgrad.wgrad_gemm_accum_fp32 if fp32 else _apex_wgrad.wgrad_gemm_accum_fp16
        kernel(total_input, grad_output, main_grad)
    else:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def drain_embedding_wgrad_compute(
    config, embedding_activation_buffer, grad_output_buffer, weight, tp_group
) -> None:
    """Compute the output layer's deferred weight gradients at the end of a pipeline drain.

    Pops every input from ``embedding_activation_buffer`` and every output gradient from
    ``grad_output_buffer`` (both emptied, in order). Under ``config.sequence_parallel`` each input
    [s/tp, b, h] is all-gathered over ``tp_group`` to [s, b, h] first. With
    ``config.gradient_accumulation_fusion`` each ``grad_output^T @ input`` (over all s*b rows) is
    added into ``weight.main_grad``; without it nothing is accumulated (as in megatron-core).

    Raises:
        MegatronCoreError: the two buffers differ in length, or main_grad is not fp32/fp16/bf16.
    """
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise MegatronCoreError(
            f"drain_embedding_wgrad_compute: {len(embedding_activation_buffer)} activations but "
            f"{len(grad_output_buffer)} output gradients; the buffers must be equally long"
        )
    while embedding_activation_buffer:
        total_input = embedding_activation_buffer.pop(0)
        grad_output = grad_output_buffer.pop(0)
        if config.sequence_parallel:
            total_input = _all_gather_first_dim(total_input, tp_group)
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        if hasattr(weight, "__fsdp_param__"):
            weight.main_grad = weight.get_main_grad()
        if config.gradient_accumulation_fusion:
            _accumulate_wgrad(grad_output, total_input, weight.main_grad)


def _sharded_tensor_type():
    try:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
    except ImportError as e:
        raise MegatronCoreError(
            "sharded tensors for dist_checkpointing need megatron-core "
            f"(pip install 'megatron_core[megatron]'), which could not be imported: {e}; "
            "megatron_core's own checkpoints (megatron_core.training, torch DCP) need no extra"
        ) from e
    return ShardedTensor


def _groups(kwargs: dict):
    """Pop tp_group / dp_cp_group from ``kwargs``; both None -> parallel_state's."""
    tp_group = kwargs.pop("tp_group", None)
    dp_cp_group = kwargs.pop("dp_cp_group", None)
    if tp_group is None and dp_cp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return tp_group, dp_cp_group


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def make_tp_sharded_tensor_for_checkpoint(
    tensor, key, tp_axis=0, replica_id=None, prepend_offsets=(), **kwargs
):
    """A megatron-core ``ShardedTensor`` for ``tensor``, split along ``tp_axis`` over TP ranks.

    This rank's shard is number ``tp_rank`` of ``tp_size`` along ``tp_axis`` (shifted by
    ``len(prepend_offsets)``, the leading dimensions ``prepend_offsets`` adds); it is
    replicated over the data x context group, replica ``(0, 0, dp_rank)`` unless ``replica_id``
    is given. A DTensor (FSDP2) contributes its local shard, also split over dp along axis 0.

    Args:
        tensor: this rank's shard.
        key: checkpoint key.
        tp_axis: the tensor-parallel axis of ``tensor``.
        replica_id: replica id; default ``(0, 0, dp_cp rank)``.
        prepend_offsets: ``(axis, rank, size)`` offsets for prepended dimensions.
        **kwargs: ``tp_group`` and ``dp_cp_group`` (both default to parallel_state's when both
            are None); the rest goes to ``ShardedTensor.from_rank_offsets``.

    Raises:
        MegatronCoreError: megatron-core is not installed (names the ``[megatron]`` extra).
    """
    sharded_tensor = _sharded_tensor_type()
    tp_group, dp_cp_group = _groups(kwargs)
    prepend_axis_num = len(prepend_offsets)
    tp_rank, tp_size = get_pg_rank(tp_group), get_pg_size(tp_group)
    dp_rank, dp_size = get_pg_rank(dp_cp_group), get_pg_size(dp_cp_group)
    offsets = [(tp_axis + prepend_axis_num, tp_rank, tp_size)]
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor, dp_replica = tensor._local_tensor, 0
        if tp_axis == 0:  # FSDP2 and TP both split axis 0: tp-major, then dp
            offsets[0] = (prepend_axis_num, tp_rank * dp_size + dp_rank, tp_size * dp_size)
        else:
            offsets.append((prepend_axis_num, dp_rank, dp_size))
    else:
        dp_replica = dp_rank
    if replica_id is None:
        replica_id = (0, 0, dp_replica)
    return sharded_tensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        *offsets,
        replica_id=replica_id,
        prepend_axis_num=prepend_axis_num,
        **kwargs,
    )


def make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=(), replica_id=None, **kwargs):
    """A megatron-core ``ShardedTensor`` for a tensor replicated over TP and data x context.

    Replica ``(0, tp_rank, dp_rank)`` unless ``replica_id`` is given. A DTensor (FSDP2) is split
    over dp along axis 0 (its full tensor is used when some rank holds no local part).

    Args: as :func:`make_tp_sharded_tensor_for_checkpoint`, without ``tp_axis``.

    Raises:
        MegatronCoreError: megatron-core is not installed (names the ``[megatron]`` extra).
    """
    sharded_tensor = _sharded_tensor_type()
    tp_group, dp_cp_group = _groups(kwargs)
    prepend_axis_num = len(prepend_offsets)
    dp_rank, dp_size = get_pg_rank(dp_cp_group), get_pg_size(dp_cp_group)
    offsets, dp_replica = [], dp_rank
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor, dp_replica = _full_tensor_if_necessary(tensor), 0
        offsets.append((prepend_axis_num, dp_rank, dp_size))
    if replica_id is None:
        replica_id = (0, get_pg_rank(tp_group), dp_replica)
    return sharded_tensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        *offsets,
        replica_id=replica_id,
        prepend_axis_num=prepend_axis_num,
        **kwargs,
    )


def _full_tensor_if_necessary(tensor):
    """A DTensor's local tensor, or its full tensor when a mesh dim outnumbers its shard dim."""
    from torch.distributed.tensor.placement_types import Shard

    for i, placement in enumerate(tensor.placements):
        if (
            isinstance(placement, Shard)
            and tensor.device_mesh.shape[i] > tensor.shape[placement.dim]
        ):
            return tensor.full_tensor()
    return tensor._local_tensor
