"""Attention over one block of keys with its log-sum-exp, fused where the device has the ops:
what context parallelism computes each block with (NOTE [ Fused attention ], rule 3)."""

from __future__ import annotations

import torch

from megatron_core import compat
from megatron_core.attention import unfused
from megatron_core.attention.choice import KernelChoice, report

__all__ = ["AttentionBlocks"]


def _dead_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """[b or 1, 1 or h, sq] True where ``mask`` hides every key of the block; None if none."""
    if mask is None:
        return None
    dead = mask.all(-1)
    return dead if bool(dead.any()) else None


class AttentionBlocks:
    """The block computation of one attention call: each block of keys with its log-sum-exp,
    merged by the caller. Decides once, from the device, dtype, dropout and backend, whether
    the blocks run torch's fused ops (:func:`megatron_core.compat.fused_attention_block_ops`) or
    the unfused fp32 computation, and reports it (NOTE [ Fused attention ], rule 2).

    Tensors are [b, h, s, d]; K/V may have fewer heads (GQA: repeated here). Outputs, lse and
    gradients come back in ``acc`` (fp32; fp64 for fp64 inputs), for the caller's merges and
    sums.

    Args:
        query: the call's query (its device and dtype decide).
        dropout_p: attention dropout; > 0 runs the unfused blocks, each block's mask drawn from
            ``seed`` + the block's id, so the backward draws it again.
        seed: the call's dropout seed (drawn by the caller from the current generator).
        backend: "auto", "fused" or "unfused" (:data:`~megatron_core.attention.ATTENTION_BACKENDS`).
        where: the caller's name, for the log line.
    """

    def __init__(self, query, dropout_p: float, seed: int, backend: str, where: str):
        self.dtype = query.dtype
        # what merges, sums and the unfused blocks compute in: fp32, or fp64 for fp64 inputs
        self.acc = torch.promote_types(query.dtype, torch.float32)
        self.dropout_p, self.seed = dropout_p, seed
        ops = compat.fused_attention_block_ops(query.device.type)
        if backend == "unfused":
            choice = KernelChoice("unfused")
        elif ops is None:
            choice = KernelChoice("unfused", f"this torch has no fused block ops on {query.device}")
        elif dropout_p:
            choice = KernelChoice("unfused", "attention dropout runs the blocks unfused")
        elif query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            choice = KernelChoice("unfused", f"no fused block op for {query.dtype}")
        else:
            choice = KernelChoice(ops.name)
        detail = f"{query.dtype}, {query.device.type}, dropout {dropout_p}"
        self.choice = report(where, choice, backend, detail)
        self.ops = ops if self.choice.fused else None

    def _dropout(self, block_id: int):
        return (self.dropout_p, self.seed + block_id) if self.dropout_p else None

    @staticmethod
    def _heads(k: torch.Tensor, heads: int) -> torch.Tensor:
        return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)

    def _bias(self, mask):
        if mask is None:
            return None
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        return bias.masked_fill_(mask, float("-inf"))

    def forward(self, q, k, v, causal: bool, scale: float, mask=None, block_id: int = 0):
        """(out fp32 [b, h, sq, d], lse fp32 [b, h, sq]) of ``q`` over keys ``k`` / ``v``;
        ``causal`` top-left aligned, ``mask`` bool (True = masked out) or None."""
        h = q.shape[1]
        k, v = self._heads(k, h), self._heads(v, h)
        if self.ops is None:
            return unfused.block_forward(
                q.to(self.acc),
                k.to(self.acc),
                v.to(self.acc),
                causal,
                scale,
                mask,
                self._dropout(block_id),
            )
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, lse, _ = self.ops.forward(q, k, v, self._bias(mask), causal, scale)
        out = out.to(self.acc)
        dead = _dead_rows(mask)
        if dead is not None:  # the kernels give such rows lse 0; they hold no probability
            lse = lse.masked_fill(dead, float("-inf"))
            out = out.masked_fill(dead.unsqueeze(-1), 0.0)
        return out, lse

    def backward(self, q, k, v, causal, scale, dout, out, lse, delta, mask=None, block_id=0):
        """(dq, dk, dv) fp32 of one block, from the whole row's ``out``, ``lse`` (fp32) and
        ``delta`` = rowsum(dout * out); dk / dv summed back onto the K/V heads."""
        h, kv = q.shape[1], k.shape[1]
        k, v = self._heads(k, h), self._heads(v, h)
        if self.ops is None:
            q, k, v = (x.to(self.acc) for x in (q, k, v))
            dq, dk, dv = unfused.block_backward(
                q, k, v, causal, scale, dout, lse, delta, mask, self._dropout(block_id)
            )
        else:
            finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).contiguous()
            with torch.autocast(device_type=q.device.type, enabled=False):
                dq, dk, dv = self.ops.backward(
                    dout.to(self.dtype), q, k, v, out.to(self.dtype), finite, None,
                    self._bias(mask), causal, scale,
                )  # fmt: skip
            dq, dk, dv = dq.to(self.acc), dk.to(self.acc), dv.to(self.acc)
        if kv != h:
            b, _, s, d = dk.shape
            dk = dk.view(b, kv, h // kv, s, d).sum(dim=2)
            dv = dv.view(b, kv, h // kv, s, d).sum(dim=2)
        return dq, dk, dv
