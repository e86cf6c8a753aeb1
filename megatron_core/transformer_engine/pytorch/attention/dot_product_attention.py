"""``transformer_engine.pytorch.DotProductAttention`` on this package's attention core.

# NOTE [ Stand-in DotProductAttention ]
1. The core. Every call runs :func:`megatron_core.attention.dot_product_attention` (fused SDPA
   kernels where the inputs allow, the named unfused fallback otherwise: NOTE [ Fused
   attention ]) or, with a context-parallel group of more than one rank,
   :func:`megatron_core.context_parallel.context_parallel_attention` (NOTE [ Context
   parallelism ]). The output is [sq, b, h * d] (sbhd) or [b, sq, h * d] (bshd), as
   Transformer Engine returns it.
2. Masks, by ``attn_mask_type`` (Transformer Engine's rules): ``no_mask`` and ``causal``
   ignore ``attention_mask`` (megatron-core passes its causal mask anyway); ``causal`` is
   top-left aligned, ``*_bottom_right`` aligns the diagonal to the last query and key;
   ``padding*`` take [b, 1, 1, s] (self-attention) or a pair ([b, 1, 1, sq], [b, 1, 1, sk])
   (cross-attention), True on padded positions, and mask a pair (i, j) when either is padded
   (a padded query's row is all masked and its output zeros); without a mask, ``cu_seqlens_q``
   / ``cu_seqlens_kv`` give the lengths (padding at the end). ``arbitrary`` takes a bool mask
   broadcastable to [b, h, sq, sk]. A ``window_size`` other than (-1, -1) / (-1, 0) (sliding
   window) becomes part of the mask: query i sees keys i + sk - sq - left .. i + sk - sq +
   right (top-left for causal types).
3. Dropout on the probabilities with ``attention_dropout`` in training mode, drawn inside
   ``get_rng_state_tracker().fork()`` when a tracker is given and the layer is not sequence
   parallel (Transformer Engine's rule, and megatron-core's local attention's); a recompute
   replays it (NOTE [ RNG streams ]).
4. Context parallelism (``cp_group`` of size > 1, from the constructor or
   ``set_context_parallel_group``): the comm types p2p, all_gather and a2a, causal or no mask
   (an ``arbitrary`` mask of megatron-core's CP form [b or 1, 1, s/cp, s] passes through);
   padding masks, sliding windows and the hierarchical ``a2a+p2p`` are refused by name.
5. Packed sequences ("thd", megatron-core's ``packed_seq_params``): each sequence of
   ``cu_seqlens_q`` / ``cu_seqlens_kv`` (and their ``_padded`` starts) attends to its own keys
   through the core, padding tokens get zeros (``packed.py``); not with context parallelism.
   Key and value heads of different sizes (multi-latent attention: 192 and 128) run with the
   smaller zero-padded to the larger (the scores and the output's first d_v channels are
   exactly those of the unpadded computation; the scale stays the key size's).
   Refused by name (NOTE [ Transformer Engine stand-in ], rule 5): attention bias and ALiBi,
   softmax types other than "vanilla", ``inference_params``, FP8 output, and THD or
   ``return_max_logit`` with context parallelism.
6. ``return_max_logit`` (megatron-core's QK-clip and max-logit logging): the forward also
   returns max_logit [h], the largest score q k^T * scale per head over the batch and every
   query and key the mask lets through, computed apart without gradient in fp32 (query rows in
   blocks of 128, so no [s, s] matrix of all heads is held at once), as Transformer Engine's
   unfused backend defines it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_core.attention import dot_product_attention
from megatron_core.context_parallel import context_parallel_attention
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.entry_points import checkpoint as tp_checkpoint
from megatron_core.transformer_engine._refuse import not_provided, refuse_if_set
from megatron_core.transformer_engine.pytorch.attention.masks import (
    attention_mask_for,
    check_window,
    normalize_mask_type,
)
from megatron_core.transformer_engine.pytorch.attention.packed import attend_packed
from megatron_core.transformer_engine.pytorch.module.base import TransformerEngineBaseModule

__all__ = ["DotProductAttention"]

_FORMATS = ("sbhd", "bshd", "thd")


def _drop_missing_extra_state(module, incompatible_keys) -> None:
    """NOTE [ Extra state of Transformer Engine modules ], rule 4."""
    missing = incompatible_keys.missing_keys
    for key in [k for k in missing if k.endswith("core_attention._extra_state")]:
        missing.remove(key)


@torch.no_grad()
def max_logit(q, k, mask, causal: bool, scale: float, block: int = 128) -> torch.Tensor:
    """[h]: the largest q k^T * scale per head over the batch and every (query, key) pair the
    mask (and causal order) lets through (NOTE rule 6); -inf for a head that sees nothing.

    Args:
        q: [sq, b, h, d]; k: [sk, b, h_kv, d]; mask: bool broadcastable to [b, h, sq, sk],
            True = masked out, or None.
    """
    sq, sk, heads = q.shape[0], k.shape[0], q.shape[2]
    keys = k.float().permute(1, 2, 3, 0).repeat_interleave(heads // k.shape[2], dim=1)
    best = torch.full((heads,), float("-inf"), device=q.device)
    for start in range(0, sq, block):
        rows = q[start : start + block].float().permute(1, 2, 0, 3)  # [b, h, rows, d]
        scores = rows @ keys * scale  # [b, h, rows, sk]
        hidden = torch.zeros(1, 1, rows.shape[2], sk, dtype=torch.bool, device=q.device)
        if causal:
            i = torch.arange(start, start + rows.shape[2], device=q.device)[:, None]
            hidden = hidden | (torch.arange(sk, device=q.device)[None, :] > i)
        if mask is not None:
            hidden = hidden | mask[..., start : start + rows.shape[2], :]
        scores = scores.masked_fill(hidden, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


class DotProductAttention(TransformerEngineBaseModule):
    """softmax(q k^T * scale + mask) v per head, on this package's attention core (NOTE [
    Stand-in DotProductAttention]).

    Args:
        num_attention_heads: query heads (all of them; this rank holds heads / tp_size).
        kv_channels: the head size, or (key size, value size) (equal here).
        num_gqa_groups: key/value heads (grouped-query attention); default the query heads.
        attention_dropout: dropout on the attention probabilities in training mode.
        qkv_format: "sbhd" or "bshd" ("thd" is refused).
        attn_mask_type: the default mask type (NOTE rule 2).
        window_size: (left, right) sliding window, None or (-1, -1) for none.
        sequence_parallel, tp_size, tp_group: the tensor-parallel layout (sizes only).
        get_rng_state_tracker: the tracker whose stream dropout draws from.
        layer_number, attention_type: kept ("self" or "cross").
        cp_group, cp_global_ranks, cp_stream, cp_comm_type: context parallelism (NOTE rule 4).
        softmax_scale: default 1 / sqrt(head size).
        softmax_type: only "vanilla".
        return_max_logit: also return the per-head maximum score (NOTE rule 6).

    Raises:
        MegatronCoreError: a refused option, heads not divisible by the groups, an unknown mask
            type or format.
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        tp_group=None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks: list[int] | None = None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool | None = False,
    ) -> None:
        super().__init__()
        owner = "DotProductAttention"
        if softmax_type != "vanilla":
            raise not_provided(f"{owner}(softmax_type={softmax_type!r}): softmax with an offset")
        self._check_format(qkv_format)
        k, v = (kv_channels, kv_channels) if isinstance(kv_channels, int) else kv_channels
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if num_attention_heads % groups:
            raise MegatronCoreError(
                f"{owner}: num_attention_heads ({num_attention_heads}) must be divisible by "
                f"num_gqa_groups ({groups})"
            )
        self.attn_mask_type = normalize_mask_type(owner, attn_mask_type)
        check_window(owner, window_size)
        self.qkv_format, self.window_size = qkv_format, window_size
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = k, v
        self.attention_dropout = float(attention_dropout)
        self.attention_type, self.layer_number = attention_type, layer_number or 1
        self.softmax_scale = 1.0 / math.sqrt(k) if softmax_scale is None else softmax_scale
        self.softmax_type, self.return_max_logit = softmax_type, return_max_logit
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_size = int(tp_size) if tp_group is None else tp_group.size()
        if tp_group is not None or self.tp_size == 1:
            self.set_tensor_parallel_group(tp_group)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.register_load_state_dict_post_hook(_drop_missing_extra_state)

    @staticmethod
    def _check_format(qkv_format: str) -> None:
        if qkv_format not in _FORMATS:
            raise MegatronCoreError(
                f"DotProductAttention: qkv_format ({qkv_format!r}) not in {_FORMATS}"
            )

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """Attend across ``cp_group`` with ``cp_comm_type`` (NOTE rule 4); None for no CP.

        Raises:
            MegatronCoreError: a list of groups / ``"a2a+p2p"`` (hierarchical CP).
        """
        if isinstance(cp_group, (list, tuple)) or cp_comm_type == "a2a+p2p":
            raise not_provided(
                f"DotProductAttention(cp_comm_type={cp_comm_type!r}): hierarchical context "
                "parallelism",
                "Use cp_comm_type 'p2p', 'all_gather' or 'a2a'",
            )
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask=None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        fast_zero_fill: bool = True,
        inference_params=None,
        pad_between_seqs: bool | None = None,
        fp8_output: bool | None = False,
        num_splits: int | None = 1,
    ) -> torch.Tensor:
        """Attention of ``query_layer`` over ``key_layer`` / ``value_layer``.

        Args:
            query_layer: [sq, b, h, d] (sbhd), [b, sq, h, d] (bshd) or [t, h, d] (thd: packed
                sequences, NOTE rule 5), this rank's heads.
            key_layer, value_layer: [sk, b, h_kv, d], [b, sk, h_kv, d] or [t_kv, h_kv, d]; the
                value's head size may differ from the key's.
            attention_mask: as ``attn_mask_type`` asks (NOTE rule 2; not used with thd).
            qkv_format, attn_mask_type, window_size: override the constructor's.
            cu_seqlens_q, cu_seqlens_kv: cumulative sequence lengths: thd's sequences, or the
                lengths for padding masks without a mask.
            cu_seqlens_q_padded, cu_seqlens_kv_padded: thd's sequence starts (padding between
                sequences).
            checkpoint_core_attention: recompute the attention in backward.
            max_seqlen_*, fast_zero_fill, pad_between_seqs, num_splits: accepted (no effect on
                this path).
            core_attention_bias_type, core_attention_bias, alibi_slopes: refused unless at their
                defaults.
            inference_params, fp8_output: refused unless at their defaults.

        Returns:
            [sq, b, h * d_v] (sbhd), [b, sq, h * d_v] (bshd) or [t, h * d_v] (thd); with
            ``return_max_logit`` also max_logit [h] (NOTE rule 6).
        """
        fmt = qkv_format or self.qkv_format
        self._check_format(fmt)
        if core_attention_bias_type != "no_bias" or core_attention_bias is not None:
            raise not_provided(
                f"DotProductAttention.forward(core_attention_bias_type="
                f"{core_attention_bias_type!r}): attention bias"
            )
        refuse_if_set(
            "DotProductAttention.forward",
            {
                "alibi_slopes": alibi_slopes is not None,
                "inference_params": inference_params is not None,
                "fp8_output": fp8_output,
            },
            "a feature the attention core does not have",
        )
        q, k, v = query_layer, key_layer, value_layer
        mask_type = normalize_mask_type(
            "DotProductAttention", attn_mask_type or self.attn_mask_type
        )
        window = self.window_size if window_size is None else window_size
        cp = self.cp_group is not None and self.cp_group.size() > 1
        if self.return_max_logit and cp:
            raise not_provided(
                "DotProductAttention(return_max_logit=True) with context parallelism"
            )

        def attend(q, k, v, mask, causal):
            if checkpoint_core_attention:
                return tp_checkpoint(self._attend, False, q, k, v, mask, causal, cp)
            return self._attend(q, k, v, mask, causal, cp)

        def logits(q, k, mask, causal):
            return max_logit(q, k, mask, causal, self.softmax_scale)

        if fmt == "thd":
            if cp:
                raise not_provided(
                    "DotProductAttention: packed sequences (thd) with context parallelism"
                )
            out, best = attend_packed(
                attend, q, k, v, mask_type, window, cu_seqlens_q, cu_seqlens_kv,
                cu_seqlens_q_padded, cu_seqlens_kv_padded,
                logits if self.return_max_logit else None,
            )  # fmt: skip
            out = out.reshape(out.shape[0], -1)
            return (out, best) if self.return_max_logit else out
        if fmt == "bshd":
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        causal, mask = attention_mask_for(
            mask_type, attention_mask, q.shape[0], k.shape[0], q.shape[1], window,
            cu_seqlens_q, cu_seqlens_kv, q.device, cp,
        )  # fmt: skip
        out = attend(q, k, v, mask, causal)
        out = out.reshape(out.shape[0], out.shape[1], -1)
        out = out.transpose(0, 1) if fmt == "bshd" else out
        if self.return_max_logit:
            return out, logits(q, k, mask, causal)
        return out

    def _attend(self, q, k, v, mask, causal: bool, cp: bool) -> torch.Tensor:
        """The core call with dropout in the tracker's stream (NOTE rules 1, 3, 4)."""
        dropout = self.attention_dropout if self.training else 0.0
        fork = None
        if dropout and self.get_rng_state_tracker is not None and not self.sequence_parallel:
            fork = self.get_rng_state_tracker().fork()
        options = dict(
            causal=causal, attention_mask=mask, softmax_scale=self.softmax_scale, dropout_p=dropout
        )
        d_k, d_v = k.shape[-1], v.shape[-1]
        if d_k < d_v:  # NOTE rule 5: zero channels change no score
            q, k = (F.pad(x, (0, d_v - d_k)) for x in (q, k))
        elif d_v < d_k:
            v = F.pad(v, (0, d_k - d_v))
        with fork if fork is not None else contextlib.nullcontext():
            if cp:
                out = context_parallel_attention(
                    q, k, v, cp_group=self.cp_group, cp_comm_type=self.cp_comm_type, **options
                )
            else:
                out = dot_product_attention(q, k, v, where="DotProductAttention", **options)
        return out[..., :d_v] if d_v < d_k else out
