"""The collectives of tensor and sequence parallelism, without autograd (private).

The one place in tensor_parallel that calls torch.distributed's data collectives: the region
functions of ``mappings.py`` and the overlapped backward of ``linear/autograd.py`` call only these.
Every function returns a fresh tensor and leaves its input untouched.

# NOTE [ Fresh contiguous buffers ]
1. Every collective reads a contiguous tensor and writes a buffer this module just allocated.
   gloo ignores the layout of a non-contiguous tensor, so its ``.contiguous()`` copy is what gets
   reduced; reducing that copy in place and returning the original (megatron-core's ``_reduce``)
   loses the result, e.g. for the expanded ones-gradient that ``out.sum().backward()`` produces.
2. Nothing is reduced in place into a tensor this module does not own: a forward input may be used
   elsewhere, and autograd may hand the same gradient tensor to several consumers. The price is one
   extra activation-sized buffer per all-reduce, except where the caller hands its own fresh
   tensor over (``all_reduce_async(..., owned=True)``: the linear functions' input gradients).

# NOTE [ Half-precision sums ]
1. gloo adds bf16 (and fp16) tensors in their own precision, rounding after every partial sum and
   in an order that differs between elements: four equal bf16 inputs 1 + 3 * 2**-7 summed to
   4.03125 in one element and 4.0625 in the next. Sums over a gloo group therefore upcast half
   precision to fp32, reduce, and round once back to the input dtype: the result is the exactly
   rounded sum of (up to 2**8) addends, the same in every element and on every rank.
2. Other backends (NCCL) reduce half precision natively, as megatron-core relies on; the upcast
   would double the bytes sent.
3. Gathers, scatters and all-to-all move values without arithmetic and never upcast.

Disagreeing ranks (megatron_core.consistency): each collective below first calls
``consistency.check_collective`` (an agreement in check mode and the default window, a record of
the per-iteration digest after it, nothing when off: NOTE [ Check window ]), the uneven paths
and all-to-all always agree on their split sizes (``consistency.agreed_splits``), and a failure
inside torch (timeout, dead peer) leaves as a CollectiveError naming the collective and the
group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_core import compat, consistency, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state import deadline
from megatron_core.parallel_state.handed import Handed, is_recording
from megatron_core.tensor_parallel.utils import split_tensor_along_last_dim

_all_gather_single = compat.all_gather_single
_reduce_scatter_single = compat.reduce_scatter_single

_HALF = (torch.float16, torch.bfloat16)
_UPCAST_SUM_BACKENDS = ("gloo",)  # see NOTE [ Half-precision sums ], rule 1


def default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or parallel_state's tensor-model-parallel group when it is None."""
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


def size_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    """(size, rank of this process) of ``group``; raises if this process is not a member."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise MegatronCoreError(f"global rank {dist.get_rank()} is not a member of group {group}")
    return dist.get_world_size(group), rank


def backend_for(tensor: torch.Tensor, group: dist.ProcessGroup) -> str:
    """The backend that carries ``tensor`` over ``group``: the group's backend, or for a
    per-device map such as ``cuda:nccl,cpu:gloo`` the entry of the tensor's device type."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return backend
    entries = dict(entry.split(":", 1) for entry in backend.split(",") if ":" in entry)
    return entries.get(tensor.device.type, backend)


def _sum_dtype(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.dtype:
    """The dtype a sum over ``group`` runs in (NOTE [ Half-precision sums ])."""
    if tensor.dtype in _HALF and backend_for(tensor, group) in _UPCAST_SUM_BACKENDS:
        return torch.float32
    return tensor.dtype


class Pending:
    """An asynchronous collective: ``wait()`` blocks until it is done and returns its result."""

    def __init__(
        self,
        work: dist.Work | None,
        finish: Callable[[], torch.Tensor],
        op="",
        group=None,
        handed: Handed | None = None,
    ):
        self._work, self._finish, self._op, self._group = work, finish, op, group
        self._handed = handed

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with consistency.named_failures(self._op, self._group):
                deadline.wait(self._work, self._op, self._group)  # NOTE [ Peer deadline ]
            self._work = None  # the last reference here: gloo's worker may still hold one
            if self._handed is not None:  # NOTE [ Frees the CPU profiler records ]
                self._handed.settle()
        return self._finish()


def _check_dims(input_: torch.Tensor, what: str) -> None:
    if input_.dim() == 0:
        raise MegatronCoreError(f"{what}: input must be at least 1-D (got a 0-d tensor)")


def check_split_sizes(sizes: Sequence[int], world_size: int, what: str) -> list[int]:
    """``sizes`` as a list of ints after checking it holds one non-negative size per rank."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != world_size or min(sizes) < 0:
        raise MegatronCoreError(
            f"{what} ({sizes}) must hold {world_size} non-negative sizes, one per rank"
        )
    return sizes


def first_dim_split(input_: torch.Tensor, world_size: int, sizes, what: str) -> list[int]:
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
    sizes = check_split_sizes(sizes, world_size, f"{what}: split sizes")
    if sum(sizes) != rows:
        raise MegatronCoreError(f"{what}: split sizes ({sizes}) must sum to the rows ({rows})")
    return sizes


# --- sums --------------------------------------------------------------------------------------


def all_reduce_async(
    input_: torch.Tensor, group: dist.ProcessGroup, *, owned: bool = False
) -> Pending:
    """Start the sum of ``input_`` over ``group``; ``wait()`` returns it.

    The sum goes into a fresh buffer, or, with ``owned=True`` (the caller hands ``input_`` over,
    e.g. a gradient it just computed), into ``input_`` itself when it is contiguous and needs no
    upcast (NOTE [ Fresh contiguous buffers ], rule 2).
    """
    consistency.check_collective("all_reduce", group, input_)
    dtype = _sum_dtype(input_, group)
    in_place = owned and dtype == input_.dtype and input_.is_contiguous()
    if in_place:
        buffer = input_
    else:
        buffer = input_.to(dtype, memory_format=torch.contiguous_format, copy=True)
    handed = Handed(buffer)
    with consistency.named_failures("all_reduce", group):  # torch's DETAIL check raises here
        work = dist.all_reduce(*handed.tensors, group=group, async_op=True)
    handed.release()
    return Pending(work, lambda: buffer.to(input_.dtype), "all_reduce", group, handed)


def all_reduce(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of ``input_`` over ``group`` (same shape and dtype), in a fresh tensor."""
    return all_reduce_async(input_, group).wait()


def reduce_scatter_first_dim_async(input_: torch.Tensor, group: dist.ProcessGroup) -> Pending:
    """Start the equal reduce-scatter along dim 0: rank r gets rows [r n/p, (r+1) n/p) of the
    sum; ``wait()`` returns them."""
    consistency.check_collective("reduce_scatter", group, input_)
    world_size, _ = size_rank(group)
    first_dim_split(input_, world_size, None, "reduce-scatter along the first dimension")
    dtype = _sum_dtype(input_, group)
    if is_recording() and input_.device.type == "cpu" and backend_for(input_, group) == "gloo":
        # NOTE [ Frees the CPU profiler records ], rule 3: gloo's own sum, made visible
        rows, rank = input_.size(0) // world_size, dist.get_rank(group)
        buffer = input_.to(dtype, memory_format=torch.contiguous_format, copy=True)
        handed = Handed(buffer)
        with consistency.named_failures("reduce_scatter", group):
            work = dist.all_reduce(*handed.tensors, group=group, async_op=True)
        handed.release()

        def mine() -> torch.Tensor:
            return buffer.narrow(0, rank * rows, rows).to(input_.dtype, copy=True)

        return Pending(work, mine, "reduce_scatter", group, handed)
    source = input_.to(dtype, memory_format=torch.contiguous_format)
    output = source.new_empty((source.size(0) // world_size, *source.shape[1:]))
    handed = Handed(output, source)
    with consistency.named_failures("reduce_scatter", group):
        work = _reduce_scatter_single(*handed.tensors, group=group, async_op=True)
    handed.release()
    return Pending(work, lambda: output.to(input_.dtype), "reduce_scatter", group, handed)


def reduce_scatter_first_dim(input_, group, input_split_sizes=None) -> torch.Tensor:
    """Sum over ``group``, keeping this rank's rows: an equal split, or ``input_split_sizes``."""
    if input_split_sizes is None:
        return reduce_scatter_first_dim_async(input_, group).wait()
    what = "reduce-scatter along the first dimension"
    consistency.check_collective(what, group, input_, input_split_sizes=list(input_split_sizes))
    world_size, rank = size_rank(group)

    def splits():
        sizes = first_dim_split(input_, world_size, input_split_sizes, what)
        return sizes, [sizes[rank]] * world_size

    sizes, _ = consistency.agreed_splits(what, group, splits)
    # Uneven: receive every rank's copy of this rank's rows, then sum them here.
    input_ = input_.contiguous()
    rest = tuple(input_.shape[1:])
    received = input_.new_empty((world_size * sizes[rank], *rest))
    handed = Handed(received, input_)
    with consistency.named_failures(what, group):
        pending = Pending(dist.all_to_all_single(
            *handed.tensors, [sizes[rank]] * world_size, sizes, group=group, async_op=True
        ), lambda: received, what, group, handed)  # fmt: skip
    handed.release()
    pending.wait()
    stacked = received.view(world_size, sizes[rank], *rest)
    return stacked.sum(dim=0, dtype=_sum_dtype(input_, group)).to(input_.dtype)


def reduce_scatter_last_dim(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over ``group``, keeping this rank's slice of the last dimension."""
    consistency.check_collective("reduce-scatter along the last dimension", group, input_)
    world_size, _ = size_rank(group)
    # Rank r's slice of the last dimension becomes rank r's slice of the first dimension.
    stacked = torch.cat(split_tensor_along_last_dim(input_, world_size), dim=0)
    return reduce_scatter_first_dim(stacked, group)


# --- data movement -----------------------------------------------------------------------------


def split_last_dim(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of the last dimension (no communication)."""
    world_size, rank = size_rank(group)
    return split_tensor_along_last_dim(input_, world_size)[rank].contiguous()


def split_first_dim(input_, group, split_sizes=None) -> torch.Tensor:
    """This rank's rows of the first dimension, equal or ``split_sizes`` (no communication)."""
    world_size, rank = size_rank(group)
    sizes = first_dim_split(input_, world_size, split_sizes, "split along the first dimension")
    return input_.narrow(0, sum(sizes[:rank]), sizes[rank]).contiguous()


def all_gather_first_dim_async(input_: torch.Tensor, group: dist.ProcessGroup) -> Pending:
    """Start the all-gather along dim 0 (rank order); ``wait()`` returns [p n, ...]."""
    consistency.check_collective("all_gather", group, input_)
    world_size, _ = size_rank(group)
    _check_dims(input_, "gather along the first dimension")
    input_ = input_.contiguous()
    output = input_.new_empty((world_size * input_.size(0), *input_.shape[1:]))
    handed = Handed(output, input_)
    with consistency.named_failures("all_gather", group):
        work = _all_gather_single(*handed.tensors, group=group, async_op=True)
    handed.release()
    return Pending(work, lambda: output, "all_gather", group, handed)


def all_gather_first_dim(input_, group, output_split_sizes=None) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's ``input_``, in rank order.

    With ``output_split_sizes`` the ranks may hold different numbers of rows (gloo has no uneven
    all-gather, so every rank sends its rows to every rank through all-to-all).
    """
    if output_split_sizes is None:
        return all_gather_first_dim_async(input_, group).wait()
    what = "gather along the first dimension"
    consistency.check_collective(
        what, group, shape=input_.shape[1:], dtype=input_.dtype, sizes=list(output_split_sizes)
    )
    world_size, rank = size_rank(group)

    def splits():
        _check_dims(input_, what)
        sizes = check_split_sizes(output_split_sizes, world_size, "output_split_sizes")
        if sizes[rank] != input_.size(0):
            raise MegatronCoreError(
                f"output_split_sizes[{rank}] ({sizes[rank]}) must equal this rank's first "
                f"dimension ({input_.size(0)})"
            )
        return [input_.size(0)] * world_size, sizes

    _, sizes = consistency.agreed_splits(what, group, splits)
    input_ = input_.contiguous()
    output = input_.new_empty((sum(sizes), *input_.shape[1:]))
    send = torch.cat([input_] * world_size, dim=0)
    handed = Handed(output, send)
    with consistency.named_failures(what, group):
        pending = Pending(dist.all_to_all_single(
            *handed.tensors, sizes, [input_.size(0)] * world_size, group=group, async_op=True
        ), lambda: output, what, group, handed)  # fmt: skip
    handed.release()
    pending.wait()
    return output


def all_gather_last_dim(input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenation along the last dimension of every rank's ``input_``, in rank order."""
    consistency.check_collective("gather along the last dimension", group, input_)
    world_size, _ = size_rank(group)
    _check_dims(input_, "gather along the last dimension")
    gathered = all_gather_first_dim(input_, group)
    return torch.cat(gathered.chunk(world_size, dim=0), dim=-1)


def all_to_all_first_dim(
    input_, group, output_split_sizes=None, input_split_sizes=None, async_op=False
):
    """Rank r sends its i-th block of rows to rank i and receives rank i's r-th block.

    ``async_op``: megatron-core 0.19's ``use_nccl_stream``, accepted; the exchange is always
    launched asynchronously and waited for (on NCCL it runs on NCCL's stream; on gloo the wait
    is bounded by the peer deadline, NOTE [ Peer deadline ]); the result is the same.

    Split sizes of None mean equal blocks (the output then has as many rows as the input). The
    ranks always agree on the split sizes first (one small exchange, ``consistency.agreed_splits``).
    """
    consistency.check_collective("all_to_all", group, shape=input_.shape[1:], dtype=input_.dtype)
    world_size, _ = size_rank(group)

    def splits():
        in_sizes = first_dim_split(input_, world_size, input_split_sizes, "all_to_all")
        if output_split_sizes is None:
            return in_sizes, first_dim_split(input_, world_size, None, "all_to_all")
        what = "all_to_all: output_split_sizes"
        return in_sizes, check_split_sizes(output_split_sizes, world_size, what)

    in_sizes, out_sizes = consistency.agreed_splits("all_to_all", group, splits)
    input_ = input_.contiguous()
    output = input_.new_empty((sum(out_sizes), *input_.shape[1:]))
    handed = Handed(output, input_)
    with consistency.named_failures("all_to_all", group):
        pending = Pending(dist.all_to_all_single(
            *handed.tensors, out_sizes, in_sizes, group=group, async_op=True
        ), lambda: output, "all_to_all", group, handed)  # fmt: skip
    handed.release()
    pending.wait()
    return output
