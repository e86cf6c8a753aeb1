"""Pure tensor math for tensor parallelism (no autograd classes, no modules)."""

# Divisibility, splitting along the last dimension, vocabulary ranges.
import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.utils import divide, ensure_divisibility  # noqa: F401 (megatron-core path)

# No module-level __all__ here: the package __init__ lists the public names.


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split a tensor into ``num_partitions`` equal chunks along its last dimension.

    Args:
        tensor: the tensor to split (at least 1-D).
        num_partitions: number of chunks; must divide the last dimension.
        contiguous_split_chunks: return contiguous copies instead of views.

    Returns:
        A tuple of ``num_partitions`` tensors (views of ``tensor`` unless contiguous requested).

    Raises:
        MegatronCoreError: for a 0-d tensor or a last dimension not divisible by num_partitions.
    """
    if tensor.dim() == 0:
        raise MegatronCoreError(
            "split_tensor_along_last_dim: tensor must be at least 1-D (got 0-d)"
        )
    last = tensor.size(-1)
    if not isinstance(num_partitions, int) or num_partitions < 1 or last % num_partitions:
        raise MegatronCoreError(
            f"split_tensor_along_last_dim: last dimension ({last}) of shape "
            f"{tuple(tensor.shape)} is not divisible by num_partitions ({num_partitions!r})"
        )
    chunks = torch.split(tensor, last // num_partitions, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """Vocabulary ranges of a vocab-parallel layer: rank ``r`` owns ``[first, last)``.

    The vocabulary is split into ``world_size`` equal, contiguous partitions in rank order.
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """``[first, last)`` of ``rank`` when every partition holds ``per_partition_vocab_size``.

        Raises:
            MegatronCoreError: for a negative size or a rank outside ``[0, world_size)``.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise MegatronCoreError(f"world_size ({world_size!r}) must be an integer >= 1")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise MegatronCoreError(f"rank ({rank!r}) must be in [0, world_size ({world_size}))")
        if not isinstance(per_partition_vocab_size, int) or per_partition_vocab_size < 0:
            raise MegatronCoreError(
                f"per_partition_vocab_size ({per_partition_vocab_size!r}) must be an integer >= 0"
            )
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """``[first, last)`` of ``rank`` when ``global_vocab_size`` is split over ``world_size``.

        Raises:
            MegatronCoreError: if ``world_size`` does not divide ``global_vocab_size`` or the rank
                is out of range.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise MegatronCoreError(f"world_size ({world_size!r}) must be an integer >= 1")
        if not isinstance(global_vocab_size, int) or global_vocab_size % world_size:
            raise MegatronCoreError(
                f"global_vocab_size ({global_vocab_size!r}) is not divisible by "
                f"world_size ({world_size})"
            )
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            global_vocab_size // world_size, rank, world_size
        )


# 1-D equal chunks (the distributed saved activations of a checkpoint).
# Used by checkpoint(distribute_saved_activations=True); see NOTE [ Checkpoint rules ], rule 3, in
# tensor_parallel/recompute/entry_points.py.
from megatron_core import compat, consistency, parallel_state  # noqa: E402
from megatron_core.parallel_state import deadline  # noqa: E402

_all_gather_1d = compat.all_gather_single


def _group_size_rank(group) -> tuple[int, int]:
    """(size, rank) of ``group``, defaulting to parallel_state's tensor-parallel group."""
    if group is None:
        return (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
        )
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _default_group(group):
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


def pick_group(what: str, tp_group, group):
    """``tp_group`` (megatron-core's name) or the older keyword ``group=``; not both."""
    if tp_group is not None and group is not None and tp_group is not group:
        raise MegatronCoreError(f"{what}: pass tp_group or group, not two different groups")
    return tp_group if tp_group is not None else group


def chunk_numel_1d(numel: int, world_size: int) -> int:
    """Length of each rank's 1-D chunk: ``ceil(numel / world_size)`` (0 for an empty tensor)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise MegatronCoreError(f"world_size ({world_size!r}) must be an integer >= 1")
    return -(-numel // world_size)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group=None, *, group=None
) -> torch.Tensor:
    """This rank's contiguous 1/tp slice of ``tensor`` flattened.

    Every rank's chunk has ``chunk_numel_1d(tensor.numel(), tp)`` elements. When tp does not divide
    the number of elements, the chunks at the end are zero-padded (megatron-core drops the
    remainder instead); pass the true size to :func:`gather_split_1d_tensor` as ``numel=`` to get
    exactly the original elements back. Example: 10 elements over tp=4 give chunks of 3: rank 0
    holds [0:3], rank 1 [3:6], rank 2 [6:9], rank 3 [9:10] + two zeros.

    Args:
        tensor: any shape (flattened in row-major order; a non-contiguous tensor is copied).
        new_buffer: return a fresh tensor that shares no storage with ``tensor``. Without it the
            result is a view of ``tensor`` where one is possible (a padded chunk is always new).
        tp_group: the process group to split over; default the tensor-parallel group.
        group: the same as tp_group (this package's older keyword).

    Returns:
        A 1-D tensor of ``ceil(numel / tp)`` elements on ``tensor``'s device, never requiring grad.

    Raises:
        MegatronCoreError: no group is given and parallel_state is not initialized.
    """
    group = pick_group("split_tensor_into_1d_equal_chunks", tp_group, group)
    world_size, rank = _group_size_rank(group)
    size = chunk_numel_1d(tensor.numel(), world_size)
    flat = tensor.detach().reshape(-1)
    start = min(rank * size, flat.numel())
    end = min(start + size, flat.numel())
    if end - start == size:
        part = flat[start:end]
        return part.clone() if new_buffer else part
    padded = flat.new_zeros(size)
    padded[: end - start].copy_(flat[start:end])
    return padded


def gather_split_1d_tensor(
    tensor: torch.Tensor, tp_group=None, *, numel: int | None = None, group=None
) -> torch.Tensor:
    """All-gather every rank's 1-D chunk into one flat tensor (inverse of the split above).

    Args:
        tensor: this rank's chunk, 1-D with the same number of elements on every rank.
        numel: the number of elements before splitting; the padding after it is dropped. Default
            keeps all ``tp * tensor.numel()`` elements (megatron-core's behaviour).
        tp_group: the process group to gather over; default the tensor-parallel group.
        group: the same as tp_group (this package's older keyword).

    Returns:
        A new 1-D tensor of ``numel`` (default ``tp * tensor.numel()``) elements, ready for
        ``.view(original_shape)``.

    Raises:
        MegatronCoreError: ``ceil(numel / tp)`` is not this chunk's size (``numel`` cannot have
            produced it), or no group is given and parallel_state is not initialized.
    """
    group = pick_group("gather_split_1d_tensor", tp_group, group)
    world_size, _ = _group_size_rank(group)
    consistency.check_collective(
        "gather_split_1d_tensor", _default_group(group), tensor, numel=numel
    )
    chunk = tensor.numel()
    total = world_size * chunk
    if numel is not None and chunk_numel_1d(numel, world_size) != chunk:
        raise MegatronCoreError(
            f"gather_split_1d_tensor: numel ({numel}) does not split into chunks of {chunk} "
            f"over {world_size} ranks (ceil({numel} / {world_size}) != {chunk})"
        )
    gathered = torch.empty(total, dtype=tensor.dtype, device=tensor.device)
    if total == 0:  # every rank holds an empty chunk: nothing to exchange
        return gathered
    with consistency.named_failures("gather_split_1d_tensor", _default_group(group)):
        work = _all_gather_1d(
            gathered,
            tensor.detach().reshape(-1).contiguous(),
            group=_default_group(group),
            async_op=True,
        )
        deadline.wait(work, "gather_split_1d_tensor", _default_group(group))
    return gathered if numel is None else gathered[:numel]
