"""Parameters of the tensor-parallel layers: TP attributes, weight initialization, SP gradients.

Split out of ``layers.py`` (which re-exports the public names, megatron-core's import path) so
that each file stays one idea: ``layers.py`` holds the modules, this file what they do to their
parameters.

Tensor-parallel attributes on a parameter: ``tensor_model_parallel`` (it is a shard),
``partition_dim`` and ``partition_stride`` (how it was cut); RowParallelLinear's bias and the
LayerNorm weights of a sequence-parallel model carry ``sequence_parallel`` instead (replicated, but
with partial gradients, see :func:`allreduce_sequence_parallel_grads`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parameter import Parameter

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel import _collectives
from megatron_core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
)

__all__ = [
    "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
    "allreduce_sequence_parallel_grads",
    # megatron-core 0.19 (generalized TP bookkeeping; remat size 1 here)
    "copy_gtp_attributes",
    "param_is_not_gtp_duplicate",
]

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}
# What a copy carries besides those: megatron-core 0.19's optimizer marks expert weights
# (expert_tp) and fused QKV weights (is_qkv, qkv_split_shapes), and a parameter's copy (a
# master weight, a view) keeps them. Copied only where the source has them, so under 0.16.1
# nothing changes; no default is set for them (0.19's readers use getattr).
_COPIED_ATTRIBUTES = (
    *_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS,
    "expert_tp",
    "is_qkv",
    "qkv_split_shapes",
)


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    expert_tp_group: dist.ProcessGroup | None = None,
) -> bool:
    """True if ``param`` is a TP shard, or a replicated parameter on TP rank 0 (count it once).

    Args:
        param: the parameter.
        tp_group: the tensor-parallel group whose rank 0 counts replicated parameters (a
            process group, or any object whose ``rank()`` gives this rank's place in it, as
            megatron-core reads it); default parallel_state's.
        expert_tp_group: (megatron-core 0.19) used instead of ``tp_group`` for a parameter
            reduced over the expert data-parallel group (``param.allreduce`` False).
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if expert_tp_group is not None and not getattr(param, "allreduce", True):
        tp_group = expert_tp_group
    if tp_group is not None:
        return tp_group.rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark ``tensor`` as split (``is_parallel``) along ``dim`` with ``stride``.

    Raises:
        MegatronCoreError: if any of the attributes is already set.
    """
    already = [name for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS if hasattr(tensor, name)]
    if already:
        raise MegatronCoreError(f"tensor-parallel attribute(s) {already} are already set")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the defaults (not parallel, dim -1, stride 1) for attributes it lacks."""
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy the tensor-parallel attributes ``source_tensor`` has onto ``destination_tensor``
    (megatron-core 0.19's ``expert_tp``, ``is_qkv`` and ``qkv_split_shapes`` among them)."""
    for name in _COPIED_ATTRIBUTES:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int | None = None,
    world_size: int | None = None,
    skip_set_tensor_parallel_attributes: bool = False,
) -> torch.Tensor | None:
    """Draw the full master weight on the CPU and copy this rank's slice into ``weight``.

    The (output_size, input_size) master is drawn in fp32 by ``init_method`` and cast to
    ``params_dtype``. Along ``partition_dim`` it is cut into ``world_size * stride`` chunks of
    ``per_partition_size / stride``; rank r keeps chunks r, r + world_size, ... concatenated. With
    stride 1 that is the r-th contiguous block; stride k interleaves (e.g. fused [gate; up]
    weights, where every rank needs a block of each).

    Returns:
        The master weight if ``return_master_weight``, else None.
    """
    if not skip_set_tensor_parallel_attributes:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    master_weight = torch.empty(output_size, input_size, dtype=torch.float32)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)
    if rank is None:
        rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
    chunks = torch.split(master_weight, per_partition_size // stride, dim=partition_dim)
    with torch.no_grad():
        weight.copy_(torch.cat(chunks[rank::world_size], dim=partition_dim))
    return master_weight if return_master_weight else None


def init_from_fp32_draw(init_method: Callable, tensor: torch.Tensor) -> None:
    """``init_method(tensor)`` in place; a bf16/fp16 ``tensor`` gets the fp32 draw rounded.

    torch's kernels draw half-precision tensors with other algorithms than fp32 ones (CPU torch
    <= 2.11 for every size; 2.13 for sizes that are not a multiple of its vector width), so a
    half-precision model initialized in its own dtype would not start from its fp32 twin's
    weights. Here the draw goes into an fp32 buffer of the same shape (consuming the RNG as the
    fp32 model does) and is copied in: a bf16 model is the fp32 one rounded, on every torch and
    device. Call it under ``torch.no_grad()`` for a parameter.
    """
    if tensor.dtype not in (torch.float16, torch.bfloat16):
        init_method(tensor)
        return
    buffer = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
    init_method(buffer)
    tensor.copy_(buffer)


def _initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method: Callable,
    partition_dim: int,
    stride: int = 1,
    is_expert: bool = False,
    *,
    skip_set_tensor_parallel_attributes: bool = False,
) -> None:
    """Draw this rank's shard in place on its device, inside the tracker's RNG stream (a
    half-precision shard gets the fp32 draw rounded: :func:`init_from_fp32_draw`)."""
    if not skip_set_tensor_parallel_attributes:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if is_expert:
        stream = get_expert_parallel_rng_tracker_name()
    else:
        stream = get_model_parallel_rng_tracker_name()
    with get_cuda_rng_tracker().fork(stream), torch.no_grad():
        init_from_fp32_draw(init_method, weight)


def _init_shard(
    weight,
    config,
    init_method,
    full_shape,
    partition_dim,
    stride,
    rank,
    world_size,
    keep_master_weight=False,
    is_expert=False,
):
    """Initialize a layer's weight shard the way ``config`` asks; returns the kept master weight.

    Nothing happens without ``config.perform_initialization``; ``use_cpu_initialization`` picks
    the CPU master-weight draw, otherwise the shard is drawn on its device in the RNG stream.
    """
    if not config.perform_initialization:
        return None
    if config.use_cpu_initialization:
        return _initialize_affine_weight_cpu(
            weight,
            *full_shape,
            weight.shape[partition_dim],
            partition_dim,
            init_method,
            stride,
            keep_master_weight,
            params_dtype=config.params_dtype,
            rank=rank,
            world_size=world_size,
            skip_set_tensor_parallel_attributes=True,
        )
    _initialize_affine_weight_gpu(
        weight,
        init_method,
        partition_dim,
        stride,
        is_expert,
        skip_set_tensor_parallel_attributes=True,
    )
    return None


def _resolve_tp_group(layer: str, tp_group, is_expert: bool = False):
    """(group, this rank in it, its size): the layer's size comes from its group, as in
    megatron-core; ``config.tensor_model_parallel_size`` is never read.

    Without ``tp_group`` a layer uses parallel_state's tensor-parallel group, or, for an expert
    layer, the expert-tensor-parallel group.
    """
    if tp_group is None:
        if is_expert:
            tp_group = parallel_state.get_expert_tensor_parallel_group()
        else:
            tp_group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(tp_group)
    if rank < 0:
        raise MegatronCoreError(
            f"{layer}: global rank {dist.get_rank()} is not a member of tp_group {tp_group}"
        )
    return tp_group, rank, dist.get_world_size(tp_group)


def _check_divisible(layer: str, name: str, value: int, by_name: str, by: int) -> None:
    if not isinstance(value, int) or value < 1 or value % by:
        raise MegatronCoreError(
            f"{layer}: {name} ({value!r}) must be a positive multiple of {by_name} ({by})"
        )


def _sequence_parallel(layer: str, config: ModelParallelConfig, world_size: int) -> bool:
    if config.sequence_parallel and world_size == 1:
        warnings.warn(
            f"{layer}: sequence_parallel is True but the tensor-parallel group has 1 rank; "
            "disabling sequence parallelism for this layer",
            stacklevel=3,
        )
        return False
    return config.sequence_parallel


def _new_param(config: ModelParallelConfig, *shape: int) -> Parameter:
    where = {} if config.use_cpu_initialization else {"device": device.current_device()}
    return Parameter(torch.empty(*shape, dtype=config.params_dtype, **where))


def _new_bias(config: ModelParallelConfig, size: int) -> Parameter:
    bias = _new_param(config, size)
    if config.perform_initialization:
        with torch.no_grad():
            bias.zero_()
    return bias


def _check_last_dim(layer: str, input_: torch.Tensor, expected: int) -> None:
    if input_.dim() == 0 or input_.shape[-1] != expected:
        raise MegatronCoreError(
            f"{layer}: input's last dimension (shape {tuple(input_.shape)}) must be {expected}"
        )


def _check_dtype(layer: str, input_: torch.Tensor, weight: torch.Tensor) -> None:
    """The input must have the weight's dtype unless autocast is on for its device: a local
    check that needs no peer, kept after the check window (NOTE [ Check window ], rule 7), made
    before any collective (under sequence parallelism the input is all-gathered first, and an
    input of another dtype on one rank sizes that gather differently: a gloo abort)."""
    if input_.dtype != weight.dtype and not torch.is_autocast_enabled(input_.device.type):
        raise MegatronCoreError(
            f"{layer}: input dtype {input_.dtype} is not the layer's dtype {weight.dtype} "
            "(config.params_dtype) and autocast is off; cast the input or run under "
            "torch.autocast"
        )


def allreduce_sequence_parallel_grads(
    module: torch.nn.Module, group: dist.ProcessGroup | None = None
) -> None:
    """Sum over the TP group the gradients of parameters marked ``sequence_parallel``.

    Under sequence parallelism a replicated parameter (LayerNorm weight and bias, the bias of a
    RowParallelLinear) sees only this rank's part of the sequence, so its gradient is partial
    and differs across TP ranks (megatron issue 1446). Call this after backward, before the
    optimizer step (megatron-core does it in finalize_model_grads). ``param.main_grad`` is used
    instead of ``param.grad`` where it exists. Every rank of the group must call it with the same
    parameters having gradients; gradients of one dtype go in one all-reduce.

    Args:
        module: the model (or any module) whose parameters to scan.
        group: the tensor-parallel group; default parallel_state's.
    """
    grads = []
    for param in module.parameters():
        if param.requires_grad and getattr(param, "sequence_parallel", False):
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            if grad is not None:
                grads.append(grad)
    if group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    if not grads or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = _collectives.all_reduce(torch.cat([g.reshape(-1) for g in same_dtype]), group)
        offset = 0
        for grad in same_dtype:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


# --- megatron-core 0.19: generalized-TP bookkeeping (the remat size is 1 here) ------------------


def copy_gtp_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the generalized-TP tags ``is_gtp_weight_remat`` and ``allreduce`` that ``source``
    has onto ``destination`` (e.g. an optimizer's master copy), as megatron-core 0.19 does."""
    for name in ("is_gtp_weight_remat", "allreduce"):
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_not_gtp_duplicate(param: torch.Tensor) -> bool:
    """True if ``param``'s gradient is counted once across the weight-remat group: a remat
    shard always, anything else on remat rank 0 (expert parameters, ``allreduce`` False, on
    the expert remat group). With remat size 1, as here, every parameter counts."""
    if getattr(param, "is_gtp_weight_remat", False):
        return True
    if not getattr(param, "allreduce", True):
        return parallel_state.get_expert_gtp_weight_remat_rank() == 0
    return parallel_state.get_gtp_weight_remat_rank() == 0
