"""The attention computation that materializes the scores: the named fallback of the fused
core, and of the fused blocks of context parallelism (NOTE [ Fused attention ], rules 2-3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["unfused_attention", "block_forward", "block_backward", "block_keep"]


def _hidden(sq: int, sk: int, causal: bool, mask, device) -> torch.Tensor | None:
    """Bool [.., sq, sk], True where a query must not see a key: above the diagonal (causal,
    top-left aligned) and where ``mask`` says; None when nothing is hidden."""
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1) if causal else None
    if mask is not None:
        hidden = mask if hidden is None else mask | hidden
    return hidden


def unfused_attention(query, key, value, causal: bool, mask, scale: float, dropout_p: float):
    """softmax(q k^T * scale, hidden entries at -inf) v on [s, b, h, d] tensors, the scores
    [b * h, sq, sk] materialized: the product in the inputs' dtype, the softmax in fp32, the
    dropout (drawn from the current generator: the caller's fork) on the probabilities cast back.
    A query that sees no key gets zeros.

    Args:
        query: [sq, b, h, d]; key, value: [sk, b, h_kv, d] (K/V heads repeated for GQA).
        mask: bool broadcastable to [b, h, sq, sk], True = masked out, or None.

    Returns:
        [sq, b, h, d] (a permuted view).
    """
    sq, b, h, d = query.shape
    sk, group = key.shape[0], h // key.shape[2]

    def heads_first(x: torch.Tensor, length: int) -> torch.Tensor:  # -> [b * h, s, d]
        x = x.permute(1, 2, 0, 3)
        if x.shape[1] != h:
            x = x.repeat_interleave(group, dim=1)
        return x.reshape(b * h, length, d)

    q, k, v = heads_first(query, sq), heads_first(key, sk), heads_first(value, sk)
    scores = torch.bmm(q, k.transpose(1, 2)) * scale
    if mask is not None:
        mask = mask.expand(b, h, sq, sk).reshape(b * h, sq, sk)
    hidden = _hidden(sq, sk, causal, mask, scores.device)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)
    if mask is not None:  # a row with every key hidden: zeros, not NaN
        probs = probs.masked_fill(hidden.all(-1, keepdim=True), 0.0)
    probs = probs.to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p, training=True)
    context = torch.bmm(probs, v)  # [b * h, sq, d]
    return context.view(b, h, sq, d).permute(2, 0, 1, 3)


# --- blocks with their log-sum-exp (fp32), for context parallelism -----------------------------


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key (-inf) at 0, so exp(-inf - 0) gives them p = 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_keep(shape, dropout, device) -> torch.Tensor | None:
    """The dropout mask of one block, scaled: 0 where dropped, 1 / (1 - p) where kept; None
    without dropout. ``dropout`` is ``(p, seed)``: the same seed draws the same mask, so the
    backward draws it again instead of keeping it (NOTE [ Fused attention ], rule 4)."""
    if dropout is None:
        return None
    p, seed = dropout
    generator = torch.Generator(device=device).manual_seed(seed)
    draw = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return (draw >= p).float() / (1.0 - p)


def _probs(q, k, causal, scale, mask, lse=None):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    hidden = _hidden(q.shape[2], k.shape[2], causal, mask, q.device)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _finite(lse).unsqueeze(-1)), lse


def block_forward(q, k, v, causal, scale, mask=None, dropout=None):
    """(out [b, h, sq, d], lse [b, h, sq]) of queries ``q`` [b, h, sq, d] over one block of keys
    ``k`` / ``v`` [b, h, sk, d], all fp32; ``mask`` bool broadcastable to [b, h, sq, sk] (True =
    masked out); ``dropout`` None or ``(p, seed)`` (:func:`block_keep`). The lse is that of the
    undropped scores, so blocks merge as without dropout."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        p, lse = _probs(q, k, causal, scale, mask)
        keep = block_keep(p.shape, dropout, q.device)
        if keep is not None:
            p = p * keep
        return torch.matmul(p, v), lse


def block_backward(q, k, v, causal, scale, dout, lse, delta, mask=None, dropout=None):
    """(dq, dk, dv) of one block of keys (fp32), from the whole row's ``lse`` and ``delta`` =
    rowsum(dout * out) (the softmax gradient needs no other block; with dropout too, since
    rowsum(P * dP) over the kept entries is rowsum(dout * out))."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        p, _ = _probs(q, k, causal, scale, mask, lse)
        keep = block_keep(p.shape, dropout, q.device)
        dp = torch.matmul(dout, v.transpose(-1, -2))
        if keep is not None:
            dv = torch.matmul((p * keep).transpose(-1, -2), dout)
            dp = dp * keep
        else:
            dv = torch.matmul(p.transpose(-1, -2), dout)
        ds = p * (dp - delta.unsqueeze(-1))
        dq = torch.matmul(ds, k) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q) * scale
        return dq, dk, dv
