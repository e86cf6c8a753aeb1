"""Communication regions of tensor and sequence parallelism.

Three layers: the private collectives of ``_collectives.py`` (no autograd) -> one private
autograd class per region, whose docstring says what forward and backward do and names the paper's
operator -> the public region functions with megatron-core's names and signatures, which modules
call.

Operators of the papers: in Megatron-LM (Shoeybi et al., 2019) ``f`` is identity forward /
all-reduce backward and ``g`` is all-reduce forward / identity backward; with sequence parallelism
(Korthikanti et al., 2022) ``g`` becomes all-gather forward / reduce-scatter backward along the
sequence dimension and ``g-bar`` reduce-scatter forward / all-gather backward.

Every public function takes ``group=`` (default: the tensor-model-parallel group of
:mod:`megatron_core.parallel_state`) and is a no-op returning its input when the group has one rank.
Tensor-parallel regions split and gather along the LAST dimension; sequence-parallel regions along
the FIRST dimension (the sequence dimension of ``[s, b, h]``).

Every collective lives in ``_collectives.py`` (NOTE [ Fresh contiguous buffers ], NOTE
[ Half-precision sums ]); this module only wires them into autograd.
"""

from __future__ import annotations

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import _collectives as C
from megatron_core.utils import get_tensor_model_parallel_group_if_none

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
    "all_to_all_sp2hp",
    "all_to_all_hp2sp",
]

# --- autograd classes ------------------------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient over the group backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        """The forward's result without autograd (NOTE [ megatron-core's private names ])."""
        return input_

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return C.all_reduce(grad_output, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        """The forward's result without autograd."""
        return C.all_reduce(input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        return C.all_reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; all-gather it backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        """The forward's result without autograd."""
        return C.split_last_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return C.split_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return C.all_gather_last_dim(grad_output, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        """The forward's result without autograd."""
        return C.all_gather_last_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return C.all_gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return C.split_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the first (sequence) dimension forward; all-gather backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        """The forward's result without autograd."""
        return C.split_first_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return C.split_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return C.all_gather_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g (sequence parallel): all-gather along the first dimension forward; backward
    reduce-scatter when the consumer is tensor-parallel (``tensor_parallel_output_grad``), else
    keep this rank's slice (the consumer ran the same computation on every rank)."""

    @staticmethod
    def symbolic(
        graph,
        input_,
        group,
        tensor_parallel_output_grad=True,
        output_split_sizes=None,
        use_global_buffer=False,
    ):
        """The forward's result without autograd (``use_global_buffer`` changes nothing)."""
        return C.all_gather_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad, output_split_sizes):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        return C.all_gather_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            grad = C.reduce_scatter_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        else:
            grad = C.split_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        return grad, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g-bar (sequence parallel): reduce-scatter along the first dimension forward; all-gather
    backward."""

    @staticmethod
    def symbolic(graph, input_, group, input_split_sizes=None, use_global_buffer=False):
        """The forward's result without autograd (``use_global_buffer`` changes nothing)."""
        return C.reduce_scatter_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        return C.reduce_scatter_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return C.all_gather_first_dim(grad_output, ctx.group, ctx.input_split_sizes), None, None


class _AllGatherLastDimFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; reduce-scatter along it backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        """The forward's result without autograd."""
        return C.all_gather_last_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return C.all_gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return C.reduce_scatter_last_dim(grad_output, ctx.group), None


class _ReduceScatterLastDimToTensorParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the last dimension forward; all-gather along it backward."""

    @staticmethod
    def symbolic(graph, input_, group):
        """The forward's result without autograd."""
        return C.reduce_scatter_last_dim(input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return C.reduce_scatter_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return C.all_gather_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """All-to-all along the first dimension forward; the reverse all-to-all (split sizes
    swapped) backward."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes, use_nccl_stream=False):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        ctx.use_nccl_stream = use_nccl_stream
        return C.all_to_all_first_dim(
            input_, group, output_split_sizes, input_split_sizes, async_op=use_nccl_stream
        )

    @staticmethod
    def backward(ctx, grad_output):
        grad = _AllToAll.apply(
            ctx.group,
            grad_output,
            ctx.input_split_sizes,
            ctx.output_split_sizes,
            ctx.use_nccl_stream,
        )
        return None, grad, None, None, None


# NOTE [ megatron-core's private names ]
# 1. megatron-core names four of these classes differently; its unit tests (and code written
#    against its module) reach them by those names, so each is also bound under megatron-core's.
# 2. Like megatron-core's, each region class has ``symbolic(graph, input_, group, ...)`` (the hook
#    of torch's TorchScript ONNX exporter), which returns the forward's result without autograd.
_CopyToModelParallelRegion = _CopyToTensorParallelRegion
_ReduceFromModelParallelRegion = _ReduceFromTensorParallelRegion
_ScatterToModelParallelRegion = _ScatterToTensorParallelRegion
_GatherFromModelParallelRegion = _GatherFromTensorParallelRegion
_AllGatherFromTensorParallelRegion = _AllGatherLastDimFromTensorParallelRegion
_ReduceScatterToTensorParallelRegion = _ReduceScatterLastDimToTensorParallelRegion


# --- public region functions -----------------------------------------------------------------


def _apply(region: type[torch.autograd.Function], input_, group, *args):
    """``region`` over ``group`` (default: the TP group); the input itself on a 1-rank group.

    A None group is resolved through this module's ``get_tensor_model_parallel_group_if_none``,
    as megatron-core's mappings do, so code (and tests) that patch that name here are obeyed.
    """
    group = C.default_group(get_tensor_model_parallel_group_if_none(group))
    return input_ if C.size_rank(group)[0] == 1 else region.apply(input_, group, *args)


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


def all_to_all(
    group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False
):
    """All-to-all along the first dimension (megatron-core's argument order: group first).

    Rank r sends its i-th chunk of ``input_`` to rank i and receives rank i's r-th chunk.

    Args:
        group: process group (required, as in megatron-core).
        input_: tensor to exchange.
        output_split_sizes_: rows received from each rank; None for an equal split (the
            trailing underscore is megatron-core's spelling).
        input_split_sizes: rows sent to each rank; None for an equal split.
        use_nccl_stream: (megatron-core 0.19) launch asynchronously and wait, which on NCCL
            runs the exchange on NCCL's own stream; the result is the same (also backward).
    """
    if group is None:
        raise MegatronCoreError("all_to_all: group must be a process group (got None)")
    if C.size_rank(group)[0] == 1:
        return input_
    return _AllToAll.apply(
        group, input_, output_split_sizes_, input_split_sizes, bool(use_nccl_stream)
    )


def all_to_all_sp2hp(input_, group=None):
    """Sequence-split to hidden-split: [num_tokens / tp, H] -> [num_tokens, H / tp].

    Every leading dimension is flattened into tokens. Rank r sends hidden slice i of its tokens to
    rank i and receives slice r of every rank's tokens, in rank order. Backward is
    :func:`all_to_all_hp2sp` of the gradient.

    Args:
        input_: [..., H] with this rank's tokens; H divisible by the group size.
        group: process group; default the tensor-model-parallel group.

    Returns:
        [num_tokens, H / tp], num_tokens being the tokens of all ranks.
    """
    group = C.default_group(get_tensor_model_parallel_group_if_none(group))
    world_size, _ = C.size_rank(group)
    input_ = input_.reshape(-1, input_.shape[-1])
    if input_.shape[-1] % world_size:
        raise MegatronCoreError(
            f"all_to_all_sp2hp: hidden size ({input_.shape[-1]}) is not divisible by the group "
            f"size ({world_size})"
        )
    blocks = torch.cat(input_.chunk(world_size, dim=-1), dim=0)
    return all_to_all(group, blocks)


def all_to_all_hp2sp(input_, group=None):
    """Hidden-split to sequence-split: [num_tokens, H / tp] -> [num_tokens / tp, H].

    The inverse of :func:`all_to_all_sp2hp`; backward is all_to_all_sp2hp of the gradient.

    Args:
        input_: [..., H / tp] holding every rank's tokens; the tokens divisible by the group size.
        group: process group; default the tensor-model-parallel group.

    Returns:
        [num_tokens / tp, H]: this rank's tokens with the full hidden dimension.
    """
    group = C.default_group(get_tensor_model_parallel_group_if_none(group))
    world_size, _ = C.size_rank(group)
    input_ = input_.reshape(-1, input_.shape[-1])
    if input_.shape[0] % world_size:
        raise MegatronCoreError(
            f"all_to_all_hp2sp: tokens ({input_.shape[0]}) are not divisible by the group "
            f"size ({world_size})"
        )
    exchanged = all_to_all(group, input_)
    return torch.cat(exchanged.chunk(world_size, dim=0), dim=-1)
