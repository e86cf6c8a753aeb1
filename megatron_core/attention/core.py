"""The attention core: [s, b, h, d] in and out, on torch's fused SDPA kernels where the inputs
allow, the unfused computation otherwise (NOTE [ Fused attention ], rules 1-2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_core import compat
from megatron_core.attention.choice import KernelChoice, check_backend, report
from megatron_core.attention.unfused import unfused_attention
from megatron_core.errors import MegatronCoreError

__all__ = ["dot_product_attention", "check_attention_inputs"]


def check_attention_inputs(where: str, query, key, value, attention_mask, dropout_p) -> None:
    """Raise unless query [sq, b, h, d], key = value [sk, b, h_kv, d] with h divisible by h_kv,
    ``attention_mask`` None or bool broadcastable to [b, h, sq, sk], and 0 <= dropout_p < 1.

    Raises:
        MegatronCoreError: naming ``where`` and the shapes or value that do not fit.
    """
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise MegatronCoreError(
            f"{where}: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must be [s, b, heads, head_dim] with equal key/value"
        )
    sq, b, h, d = query.shape
    if key.shape[1] != b or key.shape[3] != d or h % key.shape[2]:
        raise MegatronCoreError(
            f"{where}: key/value {tuple(key.shape)} do not fit query {tuple(query.shape)} "
            "(same b and head_dim; heads divisible by key/value heads)"
        )
    if attention_mask is not None:
        m = attention_mask
        want = (b, h, sq, key.shape[0])
        fits = m.dim() == 4 and all(n in (1, w) for n, w in zip(m.shape[:2], want[:2]))
        if not fits or tuple(m.shape[2:]) != want[2:] or m.dtype != torch.bool:
            raise MegatronCoreError(
                f"{where}: attention_mask {tuple(m.shape)} ({m.dtype}) must be bool "
                f"[b or 1, heads or 1, {sq}, {key.shape[0]}] (True = masked out)"
            )
    if not 0.0 <= float(dropout_p) < 1.0:
        raise MegatronCoreError(f"{where}: dropout_p ({dropout_p!r}) must be in [0, 1)")


def _fused_choice(q, k, v, allowed, dropout_p, is_causal, scale):
    """(choice, k, v, gqa): the kernel SDPA runs on [b, h, s, d] tensors; where torch has no
    fused kernel for grouped K/V heads, K/V repeated to every head if one has."""
    gqa = q.shape[1] != k.shape[1]
    kernel = compat.sdpa_kernel(q, k, v, allowed, dropout_p, is_causal, scale, gqa)
    if kernel in ("math", "none") and gqa:
        group = q.shape[1] // k.shape[1]
        k2, v2 = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        repeated = compat.sdpa_kernel(q, k2, v2, allowed, dropout_p, is_causal, scale, False)
        if repeated not in ("math", "none"):
            return KernelChoice(repeated), k2, v2, False
    if kernel in ("math", "none"):
        why = "torch has no fused SDPA kernel for these inputs"
        if dropout_p and q.device.type == "cpu":
            why = "torch's CPU flash kernel has no dropout"
        return KernelChoice("unfused", why), k, v, gqa
    return KernelChoice(kernel), k, v, gqa


def dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    attention_mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    where: str = "dot_product_attention",
) -> torch.Tensor:
    """softmax(q k^T * scale + masks) v per head, on torch's fused attention kernels
    (``F.scaled_dot_product_attention``: flash / memory-efficient / cuDNN on CUDA, flash on the
    CPU) where the inputs allow, else the unfused computation that materializes the scores (the
    fallback is logged once, naming why: NOTE [ Fused attention ]).

    Dropout draws from the current device generator: a caller whose heads are split across the
    tensor-parallel group wraps the call in ``get_cuda_rng_tracker().fork()`` (NOTE [ RNG
    streams ], rule 2); a recompute under the same RNG state draws the same mask.

    Args:
        query: [sq, b, h, d].
        key, value: [sk, b, h_kv, d]; h divisible by h_kv (grouped-query attention).
        causal: query i sees keys j <= i (top-left aligned when sq != sk).
        attention_mask: bool broadcastable to [b, h, sq, sk], True where a query must not see
            a key (megatron-core's convention), on top of ``causal``; None: none.
        softmax_scale: the scores' factor; 1/sqrt(d) by default.
        dropout_p: dropout on the attention probabilities (pass 0 in evaluation).
        backend: "auto" (fused where possible), "fused" (fused or an error), "unfused".
        where: the caller's name, for the log line and errors.

    Returns:
        [sq, b, h, d] in the computation's dtype (the query's, or autocast's); a row whose keys
        are all masked gets zeros.

    Raises:
        MegatronCoreError: shapes that do not fit, a bad mask, dropout or backend; "fused" asked
            where no fused kernel runs.
    """
    backend = check_backend(backend, where)
    check_attention_inputs(where, query, key, value, attention_mask, dropout_p)
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    dropout_p = float(dropout_p)
    detail = f"{query.dtype}, {query.device.type}, dropout {dropout_p}, " + (
        "mask" if attention_mask is not None else ("causal" if causal else "no mask")
    )
    if backend != "unfused":
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        kind = q.device.type
        if torch.is_autocast_enabled(kind):  # the dtype SDPA would run in decides the kernel
            low = torch.get_autocast_dtype(kind)
            q, k, v = (x.to(low) for x in (q, k, v))
        allowed = None
        if attention_mask is not None:  # SDPA's bool mask says where to attend
            allowed = ~attention_mask
            if causal:
                sq, sk = query.shape[0], key.shape[0]
                allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril_()
        is_causal = causal and attention_mask is None
        choice, k, v, gqa = _fused_choice(q, k, v, allowed, dropout_p, is_causal, scale)
        if report(where, choice, backend, detail).fused:
            extra = {"enable_gqa": True} if gqa else {}
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, **extra,
            )  # fmt: skip
            if allowed is not None:  # rows that see no key: zeros on every kernel
                out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
            return out.permute(2, 0, 1, 3)
    else:
        report(where, KernelChoice("unfused"), backend, detail)
    return unfused_attention(query, key, value, causal, attention_mask, scale, dropout_p)
