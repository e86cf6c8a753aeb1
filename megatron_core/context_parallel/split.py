"""The load-balanced sequence split of context parallelism and its inverse (NOTE [ Context
parallelism ], rule 1)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import _collectives

__all__ = [
    "cp_positions",
    "split_for_context_parallel",
    "gather_from_context_parallel",
    "get_batch_on_this_cp_rank",
    "get_pos_emb_on_this_cp_rank",
]


def _group_or_default(cp_group) -> dist.ProcessGroup | None:
    if cp_group is not None:
        return cp_group
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_context_parallel_group()


def _size_rank(cp_group) -> tuple[int, int]:
    group = _group_or_default(cp_group)
    if group is None:
        return 1, 0
    return group.size(), group.rank()


def _check_length(what: str, length: int, cp_size: int) -> None:
    if length % (2 * cp_size):
        raise MegatronCoreError(
            f"{what}: sequence length ({length}) must be divisible by 2 * context-parallel size "
            f"({2 * cp_size})"
        )


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The positions (int64, [seq_len / cp_size]) of a sequence of ``seq_len`` that context-
    parallel rank ``cp_rank`` of ``cp_size`` holds: chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of the ``2 * cp_size`` equal chunks, in that order."""
    _check_length("cp_positions", seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last_index = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last_index * chunk, (last_index + 1) * chunk, device=device)
    return torch.cat([first, second])


def split_for_context_parallel(tensor: torch.Tensor, dim: int, cp_group=None) -> torch.Tensor:
    """This rank's part of ``tensor`` along ``dim`` (the sequence dimension): its two chunks
    (``cp_positions``), concatenated; ``tensor`` itself on one rank. No collective runs.

    Raises:
        MegatronCoreError: the length along ``dim`` is not divisible by 2 * cp size.
    """
    cp_size, cp_rank = _size_rank(cp_group)
    if cp_size == 1:
        return tensor
    _check_length("split_for_context_parallel", tensor.shape[dim], cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather CP parts along the first dimension and put them in sequence order; backward
    takes this rank's part of the gradient (no sum: every rank holds the whole gradient of its
    own copy of the gathered tensor, summed over ranks where the caller reduces it)."""

    @staticmethod
    def forward(ctx, part, group):
        ctx.group = group
        size = group.size()
        gathered = _collectives.all_gather_first_dim(part.contiguous(), group)
        pieces = gathered.chunk(2 * size, dim=0)  # rank r's part = pieces 2r, 2r + 1
        order = [None] * (2 * size)
        for r in range(size):
            order[r] = pieces[2 * r]
            order[2 * size - 1 - r] = pieces[2 * r + 1]
        return torch.cat(order, dim=0)

    @staticmethod
    def backward(ctx, grad):
        size, rank = ctx.group.size(), ctx.group.rank()
        chunks = grad.chunk(2 * size, dim=0)
        return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=0), None


def gather_from_context_parallel(tensor: torch.Tensor, dim: int, cp_group=None) -> torch.Tensor:
    """The inverse of :func:`split_for_context_parallel`: every rank's part all-gathered over
    the CP group and put back in sequence order along ``dim``; differentiable (the gradient of
    the result flows to this rank's part). ``tensor`` itself on one rank."""
    group = _group_or_default(cp_group)
    if group is None or group.size() == 1:
        return tensor
    moved = tensor.movedim(dim, 0)
    return _GatherSequence.apply(moved, group).movedim(0, dim)


def get_batch_on_this_cp_rank(batch: dict, *args, cp_group=None, **kwargs) -> dict:
    """megatron-core's batch slicing for context parallelism: every tensor of ``batch`` is cut
    along its sequence dimension (2 for ``attention_mask``, 1 for the rest: [b, s, ...]) to this
    rank's two chunks; None values stay None. A new dict.

    Takes both megatron-core signatures: 0.16.1's ``(batch, cp_group=None)`` and 0.19's
    ``(batch, is_hybrid_cp, cp_group=None, ...)``; the hybrid (THD-packed) form of 0.19 is
    refused.

    Raises:
        MegatronCoreError: a sequence length not divisible by 2 * cp size, or ``is_hybrid_cp``.
    """
    is_hybrid = kwargs.pop("is_hybrid_cp", args[0] if args else False)
    if len(args) > 1 and cp_group is None:
        cp_group = args[1]
    if is_hybrid:
        raise MegatronCoreError(
            "get_batch_on_this_cp_rank: is_hybrid_cp (packed sequences of varying context "
            "parallelism) is not supported by this package's context parallelism"
        )
    cp_size, _ = _size_rank(cp_group)
    if cp_size == 1:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
            continue
        dim = 2 if key == "attention_mask" else 1
        out[key] = split_for_context_parallel(value, dim, cp_group)
    return out


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group=None):
    """This rank's rows of a position table (RoPE frequencies, position embeddings) along
    ``seq_dim``: the positions of :func:`cp_positions`, on the table's own device (no pinned
    memory, no CUDA call, unlike megatron-core's)."""
    cp_size, cp_rank = _size_rank(cp_group)
    if cp_size == 1:
        return pos_emb
    index = cp_positions(pos_emb.shape[seq_dim], cp_size, cp_rank, device=pos_emb.device)
    return pos_emb.index_select(seq_dim, index)
