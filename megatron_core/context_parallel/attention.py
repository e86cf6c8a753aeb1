"""Context-parallel core attention: ``all_gather`` and ``p2p`` (ring), autograd functions whose
blocks run on the attention core's fused block ops and whose backward recomputes each block from
what the forward saved, and ``a2a`` (Ulysses), the core on whole sequences of a head subset (NOTE
[ Context parallelism ], rules 2-4; NOTE [ Fused attention ], rule 3)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_core.attention import AttentionBlocks, check_backend, dot_product_attention
from megatron_core.attention.core import check_attention_inputs
from megatron_core.context_parallel.split import _group_or_default, cp_positions
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import _collectives

__all__ = ["CP_COMM_TYPES", "context_parallel_attention"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


# --- layouts and the merge (rule 3: merges and sums in fp32) ---------------------------------


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d] (a view)."""
    return x.permute(1, 2, 0, 3)


def _sbhd(x: torch.Tensor, dtype) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h, d] in ``dtype``, contiguous."""
    return x.permute(2, 0, 1, 3).to(dtype).contiguous()


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out, lse, block_out, block_lse):
    """Two partial results over disjoint keys merged by their log-sum-exp (fp32)."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(block_lse - safe).unsqueeze(-1)
    return out * a + block_out * b, new


def _sub_mask(mask, rows, k_pos):
    """The rows ``rows`` (a slice of this rank's queries) and the columns of the global key
    positions ``k_pos`` of ``mask`` [b or 1, 1, sq, s]; None stays None."""
    if mask is None:
        return None
    return mask[:, :, rows].index_select(-1, k_pos)


def _delta(grad: torch.Tensor, out: torch.Tensor, dtype) -> torch.Tensor:
    """rowsum(dO * O) [b, h, s] in ``dtype`` (fp32 or wider): the softmax gradient's row term."""
    return (_bhsd(grad).to(dtype) * _bhsd(out).to(dtype)).sum(-1)


def _dropout_seed(query: torch.Tensor, dropout_p: float) -> int:
    """One seed for the call's block masks, drawn from the current device generator (the
    caller's fork: NOTE [ Fused attention ], rule 4); 0 without dropout (nothing drawn)."""
    if not dropout_p:
        return 0
    return int(torch.randint(0, 2**40, (), device=query.device).item()) * 4096


# --- all_gather: K and V gathered, dK/dV reduce-scattered ---------------------------------------


def _all_gather_parts(size: int, rank: int, local: int, causal: bool, device):
    """For each of this rank's two query chunks: (query rows, [(gathered key rows, causal)]).
    The gathered K holds rank r's chunks r and 2 * size - 1 - r at rows r * local + [0, half)
    and [half, local). Causal: chunk c's queries see the chunks before c whole and chunk c
    causally (two blocks, no mask); otherwise every key (one block)."""
    half = local // 2

    def rows_of(chunk: int) -> torch.Tensor:
        owner = chunk if chunk < size else 2 * size - 1 - chunk
        start = owner * local + (0 if chunk < size else half)
        return torch.arange(start, start + half, device=device)

    if not causal:
        return [(slice(0, local), [(torch.arange(size * local, device=device), False)])]
    parts = []
    for i, chunk in enumerate((rank, 2 * size - 1 - rank)):
        blocks = [(rows_of(chunk), True)]
        if chunk:
            blocks.insert(0, (torch.cat([rows_of(c) for c in range(chunk)]), False))
        parts.append((slice(i * half, (i + 1) * half), blocks))
    return parts


def _gathered_positions(seq_len: int, size: int, device) -> torch.Tensor:
    return torch.cat([cp_positions(seq_len, size, r, device=device) for r in range(size)])


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, seq_len, causal, scale, mask, blocks):
        size, rank, local = group.size(), group.rank(), q.shape[0]
        full_k = _bhsd(_collectives.all_gather_first_dim(k.contiguous(), group))
        full_v = _bhsd(_collectives.all_gather_first_dim(v.contiguous(), group))
        k_pos = _gathered_positions(seq_len, size, q.device)
        qf = _bhsd(q)
        out = torch.empty(qf.shape, dtype=blocks.acc, device=q.device)
        lse = torch.empty(qf.shape[:3], dtype=blocks.acc, device=q.device)
        parts = _all_gather_parts(size, rank, local, causal, q.device)
        for i, (rows, key_blocks) in enumerate(parts):
            acc = acc_lse = None
            for j, (keys, diagonal) in enumerate(key_blocks):
                part = blocks.forward(
                    qf[:, :, rows], full_k.index_select(2, keys), full_v.index_select(2, keys),
                    diagonal, scale, _sub_mask(mask, rows, k_pos[keys]), 4 * rank + 2 * i + j,
                )  # fmt: skip
                acc, acc_lse = _merge(acc, acc_lse, *part)
            out[:, :, rows], lse[:, :, rows] = acc, acc_lse
        result = _sbhd(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, mask)  # local K/V: gathered again
        ctx.group, ctx.seq_len, ctx.causal, ctx.scale, ctx.blocks = (
            group, seq_len, causal, scale, blocks
        )  # fmt: skip
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask = ctx.saved_tensors
        group, blocks = ctx.group, ctx.blocks
        size, rank, local = group.size(), group.rank(), q.shape[0]
        full_k = _bhsd(_collectives.all_gather_first_dim(k.contiguous(), group))
        full_v = _bhsd(_collectives.all_gather_first_dim(v.contiguous(), group))
        k_pos = _gathered_positions(ctx.seq_len, size, q.device)
        qf, dout, outf = _bhsd(q), _bhsd(grad).to(blocks.acc), _bhsd(out).to(blocks.acc)
        delta = _delta(grad, out, blocks.acc)
        dq = torch.zeros(qf.shape, dtype=blocks.acc, device=q.device)
        dk = torch.zeros(full_k.shape, dtype=blocks.acc, device=q.device)
        dv = torch.zeros(full_v.shape, dtype=blocks.acc, device=q.device)
        parts = _all_gather_parts(size, rank, local, ctx.causal, q.device)
        for i, (rows, key_blocks) in enumerate(parts):
            for j, (keys, diagonal) in enumerate(key_blocks):
                part_dq, part_dk, part_dv = blocks.backward(
                    qf[:, :, rows], full_k.index_select(2, keys), full_v.index_select(2, keys),
                    diagonal, ctx.scale, dout[:, :, rows], outf[:, :, rows], lse[:, :, rows],
                    delta[:, :, rows], _sub_mask(mask, rows, k_pos[keys]), 4 * rank + 2 * i + j,
                )  # fmt: skip
                dq[:, :, rows] += part_dq
                dk.index_add_(2, keys, part_dk)
                dv.index_add_(2, keys, part_dv)
        # every rank's queries touched every rank's keys: sum the parts, each to its owner (fp32)
        dk = _collectives.reduce_scatter_first_dim(_sbhd(dk, blocks.acc), group)
        dv = _collectives.reduce_scatter_first_dim(_sbhd(dv, blocks.acc), group)
        return _sbhd(dq, q.dtype), dk.to(k.dtype), dv.to(v.dtype), *[None] * 6


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
    """(query rows, key rows, causal) of ring step ``step``: with the causal load-balanced split
    a block from an earlier rank is seen whole by this rank's queries through its first chunk
    only, and one from a later rank only by this rank's second chunk, unmasked; the rank's own
    block (step 0) is causal, top-left aligned (its positions rise with the local index)."""
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
    def forward(ctx, q, k, v, group, seq_len, causal, scale, mask, blocks):
        size, rank = group.size(), group.rank()
        ranks = dist.get_process_group_ranks(group)
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
            rows, keys, diagonal = _ring_part(step, rank, source, local, causal)
            k_pos = cp_positions(seq_len, size, source, device=q.device)[keys]
            part_out, part_lse = blocks.forward(
                qf[:, :, rows], _bhsd(block[0, keys]), _bhsd(block[1, keys]), diagonal, scale,
                _sub_mask(mask, rows, k_pos), rank * size + source,
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
        result = _sbhd(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, mask)
        ctx.group, ctx.ranks, ctx.seq_len = group, ranks, seq_len
        ctx.causal, ctx.scale, ctx.blocks = causal, scale, blocks
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask = ctx.saved_tensors
        group, ranks, blocks = ctx.group, ctx.ranks, ctx.blocks
        size, rank = group.size(), group.rank()
        local = q.shape[0]
        qf, dout, outf = _bhsd(q), _bhsd(grad).to(blocks.acc), _bhsd(out).to(blocks.acc)
        delta = _delta(grad, out, blocks.acc)
        dq = torch.zeros(qf.shape, dtype=blocks.acc, device=q.device)
        # a block travels with the fp32 (fp64) sums of its dK and dV; after a full turn it is home
        kf, vf = k.to(blocks.acc), v.to(blocks.acc)
        block = torch.stack([kf, vf, torch.zeros_like(kf), torch.zeros_like(vf)]).contiguous()
        for step in range(size):
            source = (rank - step) % size
            rows, keys, diagonal = _ring_part(step, rank, source, local, ctx.causal)
            k_pos = cp_positions(ctx.seq_len, size, source, device=q.device)[keys]
            part_dq, part_dk, part_dv = blocks.backward(
                qf[:, :, rows], _bhsd(block[0, keys].to(k.dtype)),
                _bhsd(block[1, keys].to(v.dtype)), diagonal, ctx.scale, dout[:, :, rows],
                outf[:, :, rows], lse[:, :, rows], delta[:, :, rows],
                _sub_mask(mask, rows, k_pos), rank * size + source,
            )  # fmt: skip
            dq[:, :, rows] += part_dq
            block[2, keys] += _sbhd(part_dk, blocks.acc)
            block[3, keys] += _sbhd(part_dv, blocks.acc)
            incoming, works = _ring_exchange(block, group, ranks)
            _wait(works)
            block = incoming
        return _sbhd(dq, q.dtype), block[2].to(k.dtype), block[3].to(v.dtype), *[None] * 6


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
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence's keys, the sequence
    split over the context-parallel group as
    :func:`~megatron_core.context_parallel.split_for_context_parallel` splits it (NOTE
    [ Context parallelism ]); each block on torch's fused kernels where the inputs allow (NOTE
    [ Fused attention ], rule 3).

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
        dropout_p: dropout on the attention probabilities, drawn from the current generator
            (the caller's fork); p2p and all_gather only (NOTE [ Fused attention ], rule 4).
        backend: "auto", "fused" or "unfused"
            (:data:`~megatron_core.attention.ATTENTION_BACKENDS`).

    Returns:
        [s/cp, b, h, d] in the query's dtype (merges and dK / dV sums in fp32).

    Raises:
        MegatronCoreError: before any collective, on every rank alike: an unknown
            ``cp_comm_type`` or backend, shapes that do not match, a local length that is odd,
            (a2a) heads not divisible by the CP size or dropout.
    """
    where = "context_parallel_attention"
    group = _group_or_default(cp_group)
    size = 1 if group is None else group.size()
    backend = check_backend(backend, where)
    if cp_comm_type not in CP_COMM_TYPES:
        raise MegatronCoreError(
            f"{where}: cp_comm_type ({cp_comm_type!r}) must be one of {CP_COMM_TYPES}"
        )
    sq = query.shape[0] if query.dim() else 0
    local_mask = attention_mask  # its columns are every key: checked below
    if attention_mask is not None and attention_mask.dim() == 4:
        local_mask = attention_mask[..., :sq]
    check_attention_inputs(where, query, key, value, local_mask, dropout_p)
    if key.shape[0] != sq:
        raise MegatronCoreError(
            f"{where}: key/value {tuple(key.shape)} must have the query's local length ({sq})"
        )
    mask = attention_mask
    if mask is not None and (mask.shape[1] != 1 or mask.shape[3] != sq * size):
        raise MegatronCoreError(
            f"{where}: attention_mask {tuple(mask.shape)} ({mask.dtype}) must be bool "
            f"[b or 1, 1, {sq}, {sq * size}] (this rank's queries, every key)"
        )
    h, d = query.shape[2], query.shape[3]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if size == 1:
        return dot_product_attention(
            query, key, value, causal=causal, attention_mask=mask, softmax_scale=scale,
            dropout_p=dropout_p, backend=backend, where=where,
        )  # fmt: skip
    if sq % 2:
        raise MegatronCoreError(
            f"{where}: the local sequence length ({sq}) must be even (the sequence is cut into "
            f"2 * cp = {2 * size} chunks)"
        )
    seq_len = sq * size
    if cp_comm_type in ("all_gather", "p2p"):
        blocks = AttentionBlocks(
            query, float(dropout_p), _dropout_seed(query, dropout_p), backend, where
        )
        function = _AllGatherAttention if cp_comm_type == "all_gather" else _RingAttention
        return function.apply(query, key, value, group, seq_len, causal, scale, mask, blocks)
    if h % size or key.shape[2] % size:
        raise MegatronCoreError(
            f"{where}: a2a needs the heads ({h}) and key/value heads ({key.shape[2]}) divisible "
            f"by the context-parallel size ({size})"
        )
    if dropout_p:
        raise MegatronCoreError(
            f"{where}: attention dropout ({dropout_p}) with cp_comm_type 'a2a' is not supported "
            "(every CP rank would draw the same masks for its own heads); use 'p2p' or "
            "'all_gather'"
        )
    # the queries become whole sequences of a head subset, in rank-chunk order: sorted into
    # sequence order, the causal mask is the core's own
    order = torch.argsort(_gathered_positions(seq_len, size, query.device))
    q, k, v = (_to_heads(x, group).index_select(0, order) for x in (query, key, value))
    if mask is not None:  # every rank's rows: the queries are now the whole sequence
        rows = _collectives.all_gather_first_dim(
            mask.movedim(2, 0).to(torch.uint8).contiguous(), group
        )
        mask = rows.index_select(0, order).movedim(0, 2).bool()
    out = dot_product_attention(
        q, k, v, causal=causal, attention_mask=mask, softmax_scale=scale, backend=backend,
        where=where,
    )  # fmt: skip
    return _to_sequence(out.index_select(0, torch.argsort(order)), group)
