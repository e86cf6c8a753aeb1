"""Communication regions of tensor and sequence parallelism (STYLE.md 3).

Three layers: the private collectives below (no autograd) -> one private autograd class per region,
whose docstring says what forward and backward do and names the paper's operator -> the public
region functions with megatron-core's names and signatures, which modules call.

Operators of the papers: in Megatron-LM (Shoeybi et al., 2019) ``f`` is identity forward /
all-reduce backward and ``g`` is all-reduce forward / identity backward; with sequence parallelism
(Korthikanti et al., 2022) ``g`` becomes all-gather forward / reduce-scatter backward along the
sequence dimension and ``g-bar`` reduce-scatter forward / all-gather backward.

Every public function takes ``group=`` (default: the tensor-model-parallel group of
:mod:`megatron_core.parallel_state`) and is a no-op returning its input when the group has one rank.
Tensor-parallel regions split and gather along the LAST dimension; sequence-parallel regions along
the FIRST dimension (the sequence dimension of ``[s, b, h]``).

# NOTE [ Fresh contiguous buffers ]
1. Every collective reads a contiguous tensor and writes a buffer this module just allocated.
   gloo ignores the layout of a non-contiguous tensor, so its ``.contiguous()`` copy is what gets
   reduced; reducing that copy in place and returning the original (megatron-core's ``_reduce``)
   loses the result, e.g. for the expanded ones-gradient that ``out.sum().backward()`` produces.
2. Nothing is reduced in place into a tensor this module does not own: a forward input may be used
   elsewhere, and autograd may hand the same gradient tensor to several consumers. The price is one
   extra activation-sized buffer per all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.utils import split_tensor_along_last_dim

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "all_to_all",
]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --- collectives without autograd (see NOTE [ Fresh contiguous buffers ]) --------------------


def _group_or_default(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


def _size_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    rank = dist.get_rank(group)
    if rank < 0:
        raise MegatronCoreError(f"global rank {dist.get_rank()} is not a member of group {group}")
    return dist.get_world_size(group), rank


def _check_dims(input_: torch.Tensor, what: str) -> None:
    if input_.dim() == 0:
        raise MegatronCoreError(f"{what}: input must be at least 1-D (got a 0-d tensor)")


def _check_split_sizes(sizes: Sequence[int], world_size: int, what: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != world_size or min(sizes) < 0:
        raise MegatronCoreError(
            f"{what} ({sizes}) must hold {world_size} non-negative sizes, one per rank"
        )
    return sizes


def _first_dim_split(input_: torch.Tensor, world_size: int, sizes, what: str) -> list[int]:
    """Rows per rank along the first dimension: ``sizes`` (checked), or an equal split."""
    _check_dims(input_, what)
    rows = input_.size(0)
    if sizes is None:
        if rows % world_size:
            raise MegatronCoreError(
                f"{what}: first dimension ({rows}) of shape {tuple(input_.shape)} is not "
                f"divisible by the group size ({world_size})"
            )
        return [rows // world_size] * world_size
    sizes = _check_split_sizes(sizes, world_size, f"{what}: split sizes")
    if sum(sizes) != rows:
        raise MegatronCoreError(f"{what}: split sizes ({sizes}) must sum to the rows ({rows})")
    return sizes


def _reduce(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    output = input_.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(output, group=group)
    return output


def _split_along_last_dim(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world_size, rank = _size_rank(group)
    return split_tensor_along_last_dim(input_, world_size)[rank].contiguous()


def _split_along_first_dim(input_, group, split_sizes=None) -> torch.Tensor:
    world_size, rank = _size_rank(group)
    sizes = _first_dim_split(input_, world_size, split_sizes, "split along the first dimension")
    return input_.narrow(0, sum(sizes[:rank]), sizes[rank]).contiguous()


def _gather_along_first_dim(input_, group, output_split_sizes=None) -> torch.Tensor:
    world_size, rank = _size_rank(group)
    _check_dims(input_, "gather along the first dimension")
    input_ = input_.contiguous()
    rest = tuple(input_.shape[1:])
    if output_split_sizes is None:
        output = input_.new_empty((world_size * input_.size(0), *rest))
        _all_gather_single(output, input_, group=group)
        return output
    # Uneven gather: gloo has no uneven all_gather, so every rank sends its input to every rank.
    sizes = _check_split_sizes(output_split_sizes, world_size, "output_split_sizes")
    if sizes[rank] != input_.size(0):
        raise MegatronCoreError(
            f"output_split_sizes[{rank}] ({sizes[rank]}) must equal this rank's first "
            f"dimension ({input_.size(0)})"
        )
    output = input_.new_empty((sum(sizes), *rest))
    send = torch.cat([input_] * world_size, dim=0)
    dist.all_to_all_single(output, send, sizes, [input_.size(0)] * world_size, group=group)
    return output


def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None) -> torch.Tensor:
    world_size, rank = _size_rank(group)
    what = "reduce-scatter along the first dimension"
    sizes = _first_dim_split(input_, world_size, input_split_sizes, what)
    input_ = input_.contiguous()
    rest = tuple(input_.shape[1:])
    if input_split_sizes is None:
        output = input_.new_empty((sizes[rank], *rest))
        _reduce_scatter_single(output, input_, group=group)
        return output
    # Uneven reduce-scatter: receive every rank's copy of this rank's chunk, then sum.
    received = input_.new_empty((world_size * sizes[rank], *rest))
    dist.all_to_all_single(received, input_, [sizes[rank]] * world_size, sizes, group=group)
    return received.view(world_size, sizes[rank], *rest).sum(dim=0)


def _gather_along_last_dim(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world_size, _ = _size_rank(group)
    _check_dims(input_, "gather along the last dimension")
    gathered = _gather_along_first_dim(input_, group)
    return torch.cat(gathered.chunk(world_size, dim=0), dim=-1)


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world_size, _ = _size_rank(group)
    # Rank r's slice of the last dimension becomes rank r's slice of the first dimension.
    stacked = torch.cat(split_tensor_along_last_dim(input_, world_size), dim=0)
    return _reduce_scatter_along_first_dim(stacked, group)


# --- autograd classes ------------------------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient over the group backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; all-gather it backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the first (sequence) dimension forward; all-gather backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g (sequence parallel): all-gather along the first dimension forward; backward
    reduce-scatter when the consumer is tensor-parallel (``tensor_parallel_output_grad``), else
    keep this rank's slice (the consumer ran the same computation on every rank)."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad, output_split_sizes):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        return _gather_along_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            grad = _reduce_scatter_along_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        else:
            grad = _split_along_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        return grad, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g-bar (sequence parallel): reduce-scatter along the first dimension forward; all-gather
    backward."""

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        return _reduce_scatter_along_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group, ctx.input_split_sizes), None, None


class _AllGatherLastDimFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; reduce-scatter along it backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_last_dim(grad_output, ctx.group), None


class _ReduceScatterLastDimToTensorParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the last dimension forward; all-gather along it backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """All-to-all along the first dimension forward; the reverse all-to-all (split sizes
    swapped) backward."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        world_size, _ = _size_rank(group)
        in_sizes = _first_dim_split(input_, world_size, input_split_sizes, "all_to_all")
        if output_split_sizes is None:  # as many rows as sent, equal parts from every rank
            out_sizes = _first_dim_split(input_, world_size, None, "all_to_all")
        else:
            what = "all_to_all: output_split_sizes"
            out_sizes = _check_split_sizes(output_split_sizes, world_size, what)
        input_ = input_.contiguous()
        output = input_.new_empty((sum(out_sizes), *input_.shape[1:]))
        dist.all_to_all_single(output, input_, out_sizes, in_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad = _AllToAll.apply(
            ctx.group, grad_output, ctx.input_split_sizes, ctx.output_split_sizes
        )
        return None, grad, None, None


# --- public region functions -----------------------------------------------------------------


def _apply(region: type[torch.autograd.Function], input_, group, *args):
    """``region`` over ``group`` (default: the TP group); the input itself on a 1-rank group."""
    group = _group_or_default(group)
    return input_ if _size_rank(group)[0] == 1 else region.apply(input_, group, *args)


def copy_to_tensor_model_parallel_region(input_, group=None):
    """f: identity forward, all-reduce of the gradient backward (enter a tensor-parallel region).

    Args:
        input_: tensor replicated on every rank of the group.
        group: process group; default the tensor-model-parallel group.
    """
    return _apply(_CopyToTensorParallelRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """g: all-reduce (sum) forward, identity backward (leave a tensor-parallel region)."""
    return _apply(_ReduceFromTensorParallelRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Keep this rank's slice of the last dimension; backward all-gathers it.

    Raises:
        MegatronCoreError: if the group size does not divide the last dimension.
    """
    return _apply(_ScatterToTensorParallelRegion, input_, group)


def gather_from_tensor_model_parallel_region(input_, group=None):
    """All-gather along the last dimension (rank order); backward keeps this rank's slice."""
    return _apply(_GatherFromTensorParallelRegion, input_, group)


def scatter_to_sequence_parallel_region(input_, group=None):
    """Keep this rank's slice of the first (sequence) dimension; backward all-gathers it.

    Raises:
        MegatronCoreError: if the group size does not divide the first dimension.
    """
    return _apply(_ScatterToSequenceParallelRegion, input_, group)


def gather_from_sequence_parallel_region(
    input_,
    tensor_parallel_output_grad=True,
    group=None,
    output_split_sizes=None,
    use_global_buffer=False,
):
    """All-gather along the first (sequence) dimension.

    Args:
        input_: this rank's part of the sequence.
        tensor_parallel_output_grad: True when the consumer of the output is tensor-parallel
            (each rank holds a partial gradient): backward reduce-scatters. False when the
            consumer is replicated: backward keeps this rank's slice of the gradient.
        group: process group; default the tensor-model-parallel group.
        output_split_sizes: first-dimension size of every rank's part, for an uneven gather.
        use_global_buffer: accepted for megatron-core compatibility; ignored (no global buffer).
    """
    del use_global_buffer
    return _apply(
        _GatherFromSequenceParallelRegion,
        input_,
        group,
        tensor_parallel_output_grad,
        output_split_sizes,
    )


def reduce_scatter_to_sequence_parallel_region(
    input_, group=None, input_split_sizes=None, use_global_buffer=False
):
    """Reduce-scatter (sum) along the first (sequence) dimension; backward all-gathers.

    Args:
        input_: full-sequence partial sums, one per rank.
        group: process group; default the tensor-model-parallel group.
        input_split_sizes: first-dimension size of every rank's result, for an uneven split.
        use_global_buffer: accepted for megatron-core compatibility; ignored (no global buffer).
    """
    del use_global_buffer
    return _apply(_ReduceScatterToSequenceParallelRegion, input_, group, input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """All-gather along the last dimension; backward reduce-scatters (sums) along it."""
    return _apply(_AllGatherLastDimFromTensorParallelRegion, input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """Reduce-scatter (sum) along the last dimension; backward all-gathers along it."""
    return _apply(_ReduceScatterLastDimToTensorParallelRegion, input_, group)


def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
    """All-to-all along the first dimension (megatron-core's argument order: group first).

    Rank r sends its i-th chunk of ``input_`` to rank i and receives rank i's r-th chunk.

    Args:
        group: process group (required, as in megatron-core).
        input_: tensor to exchange.
        output_split_sizes: rows received from each rank; None for an equal split.
        input_split_sizes: rows sent to each rank; None for an equal split.
    """
    if group is None:
        raise MegatronCoreError("all_to_all: group must be a process group (got None)")
    if _size_rank(group)[0] == 1:
        return input_
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)
