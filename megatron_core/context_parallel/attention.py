"""Context-parallel core attention: ``all_gather``, ``p2p`` (ring) and ``a2a`` (Ulysses), each
an autograd function whose backward recomputes the scores from what the forward saved (NOTE
[ Context parallelism ], rules 2-4)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_core.context_parallel.split import _group_or_default, cp_positions
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import _collectives

__all__ = ["CP_COMM_TYPES", "context_parallel_attention"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


# --- the block computation (rule 3): fp32, scores recomputed in backward -----------------------


def _scores(q, k, q_pos, k_pos, causal: bool, scale: float, mask=None) -> torch.Tensor:
    """[b, h, sq, sk] fp32 scores, -inf where a key is after the query (causal) and where
    ``mask`` ([b or 1, 1, sq, sk] bool, True = masked out) says."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(k_pos.view(1, 1, 1, -1) > q_pos.view(1, 1, -1, 1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return s


def _sub_mask(mask, rows, k_pos):
    """The rows ``rows`` (a slice of this rank's queries) and the columns of the global key
    positions ``k_pos`` of ``mask`` [b or 1, 1, sq, s]; None stays None."""
    if mask is None:
        return None
    return mask[:, :, rows].index_select(-1, k_pos)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key (-inf) at 0, so exp(-inf - 0) gives them p = 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _fp32(function):
    """Run ``function`` with autocast off: its fp32 inputs stay fp32 (rule 3)."""

    def run(q, *args):
        with torch.autocast(device_type=q.device.type, enabled=False):
            return function(q, *args)

    return run


@_fp32
def _block_forward(q, k, v, q_pos, k_pos, causal, scale, mask=None):
    """(out [b, h, sq, d], lse [b, h, sq]) of queries ``q`` over one block of keys, fp32."""
    s = _scores(q, k, q_pos, k_pos, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v), lse


@_fp32
def _block_backward(q, k, v, q_pos, k_pos, causal, scale, dout, lse, delta, mask=None):
    """(dq, dk, dv) of one block of keys, from the whole row's ``lse`` and
    ``delta`` = rowsum(dout * out) (the softmax gradient needs no other block)."""
    s = _scores(q, k, q_pos, k_pos, causal, scale, mask)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv


def _merge(out, lse, block_out, block_lse):
    """Two partial results over disjoint keys merged by their log-sum-exp (fp32)."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(block_lse - safe).unsqueeze(-1)
    return out * a + block_out * b, new


def _bhsd(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[s, b, h, d] -> fp32 [b, h * groups, s, d] (K/V heads repeated for GQA)."""
    x = x.permute(1, 2, 0, 3).float()
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _sbhd(x: torch.Tensor, dtype, kv_heads: int | None = None) -> torch.Tensor:
    """fp32 [b, h, s, d] -> [s, b, h, d] in ``dtype``; with ``kv_heads``, the gradient of
    repeated K/V heads summed back onto them."""
    if kv_heads is not None and x.shape[1] != kv_heads:
        b, h, s, d = x.shape
        x = x.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)
    return x.permute(2, 0, 1, 3).to(dtype).contiguous()


# --- one rank: the local attention (also the core of a2a) ---------------------------------------


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal, scale, mask):
        g = q.shape[2] // k.shape[2]
        mask = _sub_mask(mask, slice(None), k_pos)
        out, lse = _block_forward(
            _bhsd(q), _bhsd(k, g), _bhsd(v, g), q_pos, k_pos, causal, scale, mask
        )
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return _sbhd(out, q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, q_pos, k_pos, out, lse, mask = ctx.saved_tensors
        g = q.shape[2] // k.shape[2]
        dout = _bhsd(grad)
        delta = (dout * out).sum(-1)
        dq, dk, dv = _block_backward(
            _bhsd(q), _bhsd(k, g), _bhsd(v, g), q_pos, k_pos, ctx.causal, ctx.scale, dout, lse,
            delta, mask,
        )  # fmt: skip
        kv = k.shape[2]
        return _sbhd(dq, q.dtype), _sbhd(dk, k.dtype, kv), _sbhd(dv, v.dtype, kv), *[None] * 5


# --- all_gather: K and V gathered, dK/dV reduce-scattered ---------------------------------------


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, seq_len, causal, scale, mask):
        size, rank = group.size(), group.rank()
        q_pos = cp_positions(seq_len, size, rank, device=q.device)
        k_pos = torch.cat([cp_positions(seq_len, size, r, device=q.device) for r in range(size)])
        mask = _sub_mask(mask, slice(None), k_pos)
        full_k = _collectives.all_gather_first_dim(k.contiguous(), group)
        full_v = _collectives.all_gather_first_dim(v.contiguous(), group)
        g = q.shape[2] // k.shape[2]
        out, lse = _block_forward(
            _bhsd(q), _bhsd(full_k, g), _bhsd(full_v, g), q_pos, k_pos, causal, scale, mask
        )
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse, mask)  # local K/V: gathered again
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return _sbhd(out, q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, q_pos, k_pos, out, lse, mask = ctx.saved_tensors
        group = ctx.group
        full_k = _collectives.all_gather_first_dim(k.contiguous(), group)
        full_v = _collectives.all_gather_first_dim(v.contiguous(), group)
        g = q.shape[2] // k.shape[2]
        dout = _bhsd(grad)
        delta = (dout * out).sum(-1)
        dq, dk, dv = _block_backward(
            _bhsd(q), _bhsd(full_k, g), _bhsd(full_v, g), q_pos, k_pos, ctx.causal, ctx.scale,
            dout, lse, delta, mask,
        )  # fmt: skip
        kv = k.shape[2]
        # every rank's queries touched every rank's keys: sum the parts, each to its owner (fp32)
        dk = _collectives.reduce_scatter_first_dim(_sbhd(dk, torch.float32, kv), group)
        dv = _collectives.reduce_scatter_first_dim(_sbhd(dv, torch.float32, kv), group)
        return _sbhd(dq, q.dtype), dk.to(k.dtype), dv.to(v.dtype), *[None] * 5


# --- p2p: the ring --------------------------------------------------------------------------------


def _ring_exchange(buffer: torch.Tensor, group, ranks: list[int]):
    """Start sending ``buffer`` to the next rank of the ring and receiving the previous rank's;
    returns (received buffer, the pending works). A device tensor on a gloo group (ranks that
    share a GPU) travels through host memory, at once."""
    size, rank = len(ranks), group.rank()
    if buffer.device.type != "cpu" and _collectives.backend_for(buffer, group) == "gloo":
        staged, works = _ring_exchange(buffer.cpu(), group, ranks)
        _wait(works)
        return staged.to(buffer.device), []
    received = torch.empty_like(buffer)
    # the receive is posted first: gloo's send of a large buffer waits for its receiver
    ops = [
        dist.P2POp(dist.irecv, received, ranks[(rank - 1) % size], group),
        dist.P2POp(dist.isend, buffer, ranks[(rank + 1) % size], group),
    ]
    return received, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


_RING_OVERLAP = True  # benchmarks: False waits for each block before computing (exposed)


def _ring_part(step: int, rank: int, source: int, local: int, causal: bool):
    """(query rows, key rows, mask) of ring step ``step``: with the causal load-balanced split a
    block from an earlier rank is seen whole by this rank's queries through its first chunk
    only, and one from a later rank only by this rank's second chunk, unmasked (rule 2)."""
    everything = slice(0, local)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    half = local // 2
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, local), everything, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, seq_len, causal, scale, mask):
        size, rank = group.size(), group.rank()
        ranks = dist.get_process_group_ranks(group)
        q_pos = cp_positions(seq_len, size, rank, device=q.device)
        g = q.shape[2] // k.shape[2]
        local = q.shape[0]
        qf = _bhsd(q)
        block = torch.stack([k, v]).contiguous()  # travels round the ring
        out = lse = None
        for step in range(size):
            last = step == size - 1
            if not last:  # the next block is on its way while this one is computed
                incoming, works = _ring_exchange(block, group, ranks)
                if not _RING_OVERLAP:
                    _wait(works)
                    works = []
            source = (rank - step) % size
            rows, keys, masked = _ring_part(step, rank, source, local, causal)
            k_pos = cp_positions(seq_len, size, source, device=q.device)[keys]
            part_out, part_lse = _block_forward(
                qf[:, :, rows], _bhsd(block[0, keys], g), _bhsd(block[1, keys], g),
                q_pos[rows], k_pos, masked, scale, _sub_mask(mask, rows, k_pos),
            )  # fmt: skip
            if out is None:
                out, lse = part_out, part_lse
            else:
                out[:, :, rows], lse[:, :, rows] = _merge(
                    out[:, :, rows], lse[:, :, rows], part_out, part_lse
                )
            if not last:
                _wait(works)
                block = incoming
        ctx.save_for_backward(q, k, v, q_pos, out, lse, mask)
        ctx.group, ctx.ranks, ctx.seq_len = group, ranks, seq_len
        ctx.causal, ctx.scale = causal, scale
        return _sbhd(out, q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, q_pos, out, lse, mask = ctx.saved_tensors
        group, ranks = ctx.group, ctx.ranks
        size, rank = group.size(), group.rank()
        g = q.shape[2] // k.shape[2]
        kv, local = k.shape[2], q.shape[0]
        qf, dout = _bhsd(q), _bhsd(grad)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qf)
        # a block travels with the fp32 sums of its dK and dV; after a full turn it is home
        block = torch.stack([k.float(), v.float(), torch.zeros_like(k, dtype=torch.float32),
                             torch.zeros_like(v, dtype=torch.float32)]).contiguous()  # fmt: skip
        for step in range(size):
            source = (rank - step) % size
            rows, keys, masked = _ring_part(step, rank, source, local, ctx.causal)
            k_pos = cp_positions(ctx.seq_len, size, source, device=q.device)[keys]
            part_dq, part_dk, part_dv = _block_backward(
                qf[:, :, rows], _bhsd(block[0, keys], g), _bhsd(block[1, keys], g),
                q_pos[rows], k_pos, masked, ctx.scale, dout[:, :, rows], lse[:, :, rows],
                delta[:, :, rows], _sub_mask(mask, rows, k_pos),
            )  # fmt: skip
            dq[:, :, rows] += part_dq
            block[2, keys] += _sbhd(part_dk, torch.float32, kv)
            block[3, keys] += _sbhd(part_dv, torch.float32, kv)
            incoming, works = _ring_exchange(block, group, ranks)
            _wait(works)
            block = incoming
        return _sbhd(dq, q.dtype), block[2].to(k.dtype), block[3].to(v.dtype), *[None] * 5


# --- a2a: Ulysses ---------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Equal parts of the first dimension exchanged over ``group`` (part i to rank i); the
    backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _collectives.all_to_all_first_dim(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return _collectives.all_to_all_first_dim(grad.contiguous(), ctx.group), None


def _to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[s/cp, b, h, d] (this rank's positions, every head) -> [s, b, h/cp, d] (every rank's
    positions in rank order, this rank's heads)."""
    size = group.size()
    s, b, h, d = x.shape
    parts = (
        x.view(s, b, size, h // size, d).permute(2, 0, 1, 3, 4).reshape(size * s, b, h // size, d)
    )
    return _AllToAll.apply(parts, group)


def _to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_to_heads`."""
    size = group.size()
    received = _AllToAll.apply(x.contiguous(), group)  # [size (head group), s/cp, b, h/cp, d]
    total, b, hp, d = received.shape
    s = total // size
    return received.view(size, s, b, hp, d).permute(1, 2, 0, 3, 4).reshape(s, b, size * hp, d)


# --- the entry point ------------------------------------------------------------------------------


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup | None = None,
    cp_comm_type: str = "p2p",
    causal: bool = True,
    softmax_scale: float | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence's keys, the sequence
    split over the context-parallel group as :func:`~megatron_core.context_parallel.
    split_for_context_parallel` splits it (NOTE [ Context parallelism ]).

    Args:
        query: [s/cp, b, h, d], this rank's positions (megatron-core's sbhd layout).
        key, value: [s/cp, b, h_kv, d]; ``h`` divisible by ``h_kv`` (GQA).
        cp_group: the context-parallel group (None: parallel_state's, or none before
            ``initialize_model_parallel``).
        cp_comm_type: ``"p2p"`` (ring), ``"all_gather"`` or ``"a2a"`` (Ulysses).
        causal: a key attends only to queries at or after its position (in the whole sequence).
        softmax_scale: the scores' factor, 1/sqrt(d) by default.
        attention_mask: bool [b or 1, 1, s/cp, s], True where a query must not see a key
            (megatron-core's mask, its rows cut as ``get_batch_on_this_cp_rank`` cuts them, its
            columns the whole sequence in order), on top of ``causal``; None: none.

    Returns:
        [s/cp, b, h, d] in the query's dtype (scores, softmax and merges in fp32).

    Raises:
        MegatronCoreError: before any collective, on every rank alike: an unknown
            ``cp_comm_type``, shapes that do not match, a local length that is odd, or (a2a)
            heads not divisible by the CP size.
    """
    group = _group_or_default(cp_group)
    size = 1 if group is None else group.size()
    if cp_comm_type not in CP_COMM_TYPES:
        raise MegatronCoreError(
            f"context_parallel_attention: cp_comm_type ({cp_comm_type!r}) must be one of "
            f"{CP_COMM_TYPES}"
        )
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        raise MegatronCoreError(
            f"context_parallel_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and "
            f"value {tuple(value.shape)} must be [s, b, heads, head_dim] with equal key/value"
        )
    sq, b, h, d = query.shape
    if key.shape[0] != sq or key.shape[1] != b or key.shape[3] != d or h % key.shape[2]:
        raise MegatronCoreError(
            f"context_parallel_attention: key/value {tuple(key.shape)} do not fit query "
            f"{tuple(query.shape)} (same s, b, head_dim; heads divisible by key/value heads)"
        )
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    mask = attention_mask
    if mask is not None:
        fits = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == 1
        if not fits or tuple(mask.shape[2:]) != (sq, sq * size) or mask.dtype != torch.bool:
            raise MegatronCoreError(
                f"context_parallel_attention: attention_mask {tuple(mask.shape)} ({mask.dtype}) "
                f"must be bool [b or 1, 1, {sq}, {sq * size}] (this rank's queries, every key)"
            )
    if size == 1:
        positions = torch.arange(sq, device=query.device)
        return _LocalAttention.apply(query, key, value, positions, positions, causal, scale, mask)
    if sq % 2:
        raise MegatronCoreError(
            f"context_parallel_attention: the local sequence length ({sq}) must be even (the "
            f"sequence is cut into 2 * cp = {2 * size} chunks)"
        )
    seq_len = sq * size
    if cp_comm_type == "all_gather":
        return _AllGatherAttention.apply(query, key, value, group, seq_len, causal, scale, mask)
    if cp_comm_type == "p2p":
        return _RingAttention.apply(query, key, value, group, seq_len, causal, scale, mask)
    if h % size or key.shape[2] % size:
        raise MegatronCoreError(
            f"context_parallel_attention: a2a needs the heads ({h}) and key/value heads "
            f"({key.shape[2]}) divisible by the context-parallel size ({size})"
        )
    positions = torch.cat(
        [cp_positions(seq_len, size, r, device=query.device) for r in range(size)]
    )
    q, k, v = (_to_heads(x, group) for x in (query, key, value))
    if mask is not None:  # every rank's rows: the queries are now the whole sequence
        rows = _collectives.all_gather_first_dim(
            mask.movedim(2, 0).to(torch.uint8).contiguous(), group
        )
        mask = rows.movedim(0, 2).bool()
    out = _LocalAttention.apply(q, k, v, positions, positions, causal, scale, mask)
    return _to_sequence(out, group)
