"""Packed variable-length sequences ("thd") for the stand-in's DotProductAttention (NOTE
[ Stand-in DotProductAttention ], rule 5).

Transformer Engine's THD layout: the sequences of a batch are packed along one token dimension,
query [t, h, d] and key / value [t_kv, h_kv, d]; ``cu_seqlens_q`` ([b + 1], cumulative) gives
each sequence's length and ``cu_seqlens_q_padded`` where it starts (with padding tokens between
sequences; the same as ``cu_seqlens_q`` without them); likewise for keys. Each sequence attends
only to its own keys. Here each sequence runs through the attention core on its own ([s_i, 1,
h, d]: one Python-level call per sequence), under the mask type without its "padding" part (the
lengths are the padding), and padding tokens get zeros, as Transformer Engine's kernels give them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.transformer_engine._refuse import not_provided
from megatron_core.transformer_engine.pytorch.attention.masks import attention_mask_for

__all__ = ["attend_packed"]

# a packed mask type -> the mask within one sequence (the lengths are the padding)
_WITHIN = {
    "padding": "no_mask",
    "no_mask": "no_mask",
    "padding_causal": "causal",
    "causal": "causal",
    "padding_causal_bottom_right": "causal_bottom_right",
    "causal_bottom_right": "causal_bottom_right",
}


def _spans(cu_seqlens: torch.Tensor, cu_padded: torch.Tensor | None, what: str):
    """[(start, length)] of each packed sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = (cu_padded if cu_padded is not None else cu_seqlens)[:-1].tolist()
    if len(starts) != len(lengths) or min(lengths, default=0) < 0:
        raise MegatronCoreError(
            f"DotProductAttention (thd): {what} {cu_seqlens.tolist()} and its padded form must "
            "be [b + 1] non-decreasing cumulative lengths"
        )
    return list(zip((int(s) for s in starts), (int(n) for n in lengths)))


def attend_packed(
    attend: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask_type: str,
    window,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_kv: torch.Tensor | None,
    cu_seqlens_q_padded: torch.Tensor | None,
    cu_seqlens_kv_padded: torch.Tensor | None,
    logits: Callable | None = None,
):
    """Attention of each packed sequence over its own keys.

    Args:
        attend: ``attend(q, k, v, mask, causal)`` on [s, 1, h, d] tensors -> [s, 1, h, d_v].
        query: [t, h, d]; key, value: [t_kv, h_kv, d] (and d_v).
        mask_type: Transformer Engine's (its "padding" part is the lengths).
        window: the sliding window, applied within each sequence.
        cu_seqlens_q, cu_seqlens_kv: [b + 1] cumulative lengths (kv: the query's when None).
        cu_seqlens_q_padded, cu_seqlens_kv_padded: [b + 1] cumulative starts, or None.
        logits: ``logits(q, k, mask, causal)`` -> [h] maximum scores, to return their maximum
            over the sequences too; None for none.

    Returns:
        ([t, h, d_v] with zeros on padding tokens, the maximum scores [h] or None).

    Raises:
        MegatronCoreError: no ``cu_seqlens_q``, an "arbitrary" mask type, or cumulative lengths
            that are not [b + 1] non-decreasing values of one batch size.
    """
    if cu_seqlens_q is None:
        raise MegatronCoreError("DotProductAttention (thd): packed sequences need cu_seqlens_q")
    if mask_type not in _WITHIN:
        raise not_provided(f"DotProductAttention (thd) with attn_mask_type {mask_type!r}")
    if cu_seqlens_kv is None:
        cu_seqlens_kv, cu_seqlens_kv_padded = cu_seqlens_q, cu_seqlens_q_padded
    queries = _spans(cu_seqlens_q, cu_seqlens_q_padded, "cu_seqlens_q")
    keys = _spans(cu_seqlens_kv, cu_seqlens_kv_padded, "cu_seqlens_kv")
    if len(queries) != len(keys):
        raise MegatronCoreError(
            f"DotProductAttention (thd): {len(queries)} query sequences and {len(keys)} key "
            "sequences"
        )
    pieces, at, best = [], 0, None
    heads, d_v = query.shape[1], value.shape[-1]

    def zeros(rows: int) -> torch.Tensor:
        return query.new_zeros(rows, heads, d_v)

    for (q_start, q_len), (k_start, k_len) in zip(queries, keys):
        if q_len == 0:
            continue
        if q_start > at:
            pieces.append(zeros(q_start - at))
        q = query[q_start : q_start + q_len].unsqueeze(1)
        k = key[k_start : k_start + k_len].unsqueeze(1)
        v = value[k_start : k_start + k_len].unsqueeze(1)
        causal, mask = attention_mask_for(
            _WITHIN[mask_type], None, q_len, k_len, 1, window, None, None, query.device, False
        )
        pieces.append(attend(q, k, v, mask, causal).squeeze(1))
        if logits is not None:
            found = logits(q, k, mask, causal)
            best = found if best is None else torch.maximum(best, found)
        at = q_start + q_len
    if at < query.shape[0]:
        pieces.append(zeros(query.shape[0] - at))
    return torch.cat(pieces) if pieces else zeros(query.shape[0]), best
