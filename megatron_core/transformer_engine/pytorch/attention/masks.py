"""Transformer Engine's attention mask types as (causal, bool mask) for the attention core
(NOTE [ Stand-in DotProductAttention ], rules 2 and 4)."""

from __future__ import annotations

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.transformer_engine._refuse import not_provided

__all__ = ["MASK_TYPES", "normalize_mask_type", "check_window", "attention_mask_for"]

MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
_NO_WINDOW = ((-1, -1), (-1, 0))


def normalize_mask_type(owner: str, mask_type: str) -> str:
    """Transformer Engine's spellings ("padding,causal", "causal_padding") as in MASK_TYPES."""
    name = mask_type.replace(",", "_")
    name = {"causal_padding": "padding_causal"}.get(name, name)
    if name not in MASK_TYPES:
        raise MegatronCoreError(f"{owner}: attn_mask_type ({mask_type!r}) not in {MASK_TYPES}")
    return name


def check_window(owner: str, window_size) -> None:
    """A window is None or a pair (left, right) of ints >= -1."""
    if window_size is None:
        return
    if len(window_size) != 2 or any(int(w) < -1 for w in window_size):
        raise MegatronCoreError(
            f"{owner}: window_size ({window_size!r}) must be (left, right) with values >= -1"
        )


def _lengths_mask(cu_seqlens: torch.Tensor, s: int, where) -> torch.Tensor:
    """[b, 1, 1, s], True past each sequence's length (from cumulative lengths)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(where)
    return (torch.arange(s, device=where) >= lengths[:, None]).view(-1, 1, 1, s)


def _padding(mask, sq: int, sk: int, cu_q, cu_kv, where) -> torch.Tensor:
    """[b, 1, sq, sk]: True where the query or the key is padding."""
    if mask is None:
        if cu_q is None:
            raise MegatronCoreError(
                "DotProductAttention: a padding mask type needs attention_mask or cu_seqlens_q"
            )
        q_pad = _lengths_mask(cu_q, sq, where)
        kv_pad = _lengths_mask(cu_q if cu_kv is None else cu_kv, sk, where)
    elif isinstance(mask, (tuple, list)):
        q_pad, kv_pad = mask
    elif mask.dim() == 4 and mask.shape[2] == sq and mask.shape[3] == sk and sq > 1:
        return mask  # already [b, 1, sq, sk]
    else:
        q_pad = kv_pad = mask
    if tuple(q_pad.shape[1:]) != (1, 1, sq) or tuple(kv_pad.shape[1:]) != (1, 1, sk):
        raise MegatronCoreError(
            f"DotProductAttention: padding masks must be [b, 1, 1, {sq}] and [b, 1, 1, {sk}]; "
            f"got {tuple(q_pad.shape)} and {tuple(kv_pad.shape)}"
        )
    return q_pad.view(-1, 1, sq, 1) | kv_pad


def _diagonal_mask(sq: int, sk: int, left: int, right: int, offset: int, where) -> torch.Tensor:
    """[1, 1, sq, sk]: True outside keys i + offset - left .. i + offset + right (-1:
    unbounded)."""
    rel = torch.arange(sk, device=where)[None, :] - torch.arange(sq, device=where)[:, None]
    rel = rel - offset
    outside = torch.zeros(sq, sk, dtype=torch.bool, device=where)
    if right >= 0:
        outside |= rel > right
    if left >= 0:
        outside |= rel < -left
    return outside.view(1, 1, sq, sk)


def attention_mask_for(
    mask_type: str,
    attention_mask,
    sq: int,
    sk: int,
    batch: int,
    window_size,
    cu_seqlens_q,
    cu_seqlens_kv,
    where,
    context_parallel: bool,
) -> tuple[bool, torch.Tensor | None]:
    """(causal, mask) for the attention core: ``causal`` top-left aligned, ``mask`` bool
    broadcastable to [b, h, sq, sk], True = masked out (NOTE [ Stand-in DotProductAttention ],
    rule 2)."""
    window = None if window_size is None else tuple(int(w) for w in window_size)
    if context_parallel:
        if "padding" in mask_type or (window is not None and window not in _NO_WINDOW):
            raise not_provided(
                f"DotProductAttention with context parallelism and attn_mask_type "
                f"{mask_type!r}, window_size {window_size!r}",
                "Use a causal or no mask (an 'arbitrary' mask of the CP form passes)",
            )
        if mask_type == "arbitrary":
            return False, attention_mask
        return mask_type in ("causal", "causal_bottom_right"), None
    mask = None
    if "padding" in mask_type:
        mask = _padding(attention_mask, sq, sk, cu_seqlens_q, cu_seqlens_kv, where)
    elif mask_type == "arbitrary":
        mask = attention_mask
    causal = "causal" in mask_type
    bottom_right = mask_type.endswith("bottom_right") or (not causal and sq != sk)
    offset = sk - sq if bottom_right else 0
    if window is not None and window not in _NO_WINDOW:
        left, right = window
        if causal:
            right = 0
        extra = _diagonal_mask(sq, sk, left, right, offset, where)
        return False, extra if mask is None else (mask | extra)
    if causal and offset:
        extra = _diagonal_mask(sq, sk, -1, 0, offset, where)
        return False, extra if mask is None else (mask | extra)
    return causal, mask
