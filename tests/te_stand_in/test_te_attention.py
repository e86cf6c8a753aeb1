"""The stand-in's DotProductAttention and rotary embeddings against plain torch references.

DotProductAttention (NOTE [ Stand-in DotProductAttention ]) is compared with an fp64 softmax
attention computed from the same inputs (GQA by repeating K/V heads, masks built from their
definitions): output and the gradients of Q, K and V, for every mask type, both layouts, a
sliding window, grouped-query attention, and context parallelism at 2 and 4 ranks for every
comm type (each rank's query rows against the full sequence's result), packed sequences (THD,
padding between them) and value heads smaller than key heads (MLA). Dropout: the checkpointed
call replays the same mask (bitwise equal outputs and gradients). RoPE: the fused path equals
an fp64 rotation; the unfused path equals Transformer Engine's formula; THD with CP rotates each
sequence's rank chunks by their global positions.

Tolerance: fp32 against fp64 at rtol = atol = 1e-5 (the core's fp32 softmax and matmuls).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from _te_checks import Report, assert_topic, leaf, randn

from megatron_core import parallel_state
from megatron_core.context_parallel import split_for_context_parallel
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_core.testing import run_distributed
from megatron_core.transformer_engine.pytorch import DotProductAttention
from megatron_core.transformer_engine.pytorch.attention.rope import (
    RotaryPositionEmbedding,
    apply_rotary_pos_emb,
)

SQ, B, H, HKV, D = 8, 2, 4, 2, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}


def reference(q, k, v, mask=None):
    """fp64 softmax(q k^T / sqrt(d) + mask) v, [s, b, h, d] in, [s, b, h*d] out; rows with
    every key masked give zeros."""
    q, k, v = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = (probs @ v).permute(2, 0, 1, 3)
    return out.reshape(out.shape[0], out.shape[1], -1)


def causal(sq, sk, offset=0):
    return torch.ones(sq, sk, dtype=torch.bool).triu(1 + offset)


def inputs(sq=SQ, sk=SQ, seed=0):
    return (
        randn(sq, B, H, D, seed=seed),
        randn(sk, B, HKV, D, seed=seed + 1),
        randn(sk, B, HKV, D, seed=seed + 2),
    )


def compare(report, name, layer, q, k, v, want_mask, fmt="sbhd", **call):
    qs, ks, vs = leaf(q), leaf(k), leaf(v)
    args = [x.transpose(0, 1) if fmt == "bshd" else x for x in (qs, ks, vs)]
    out = layer(*args, qkv_format=fmt, **call)
    if fmt == "bshd":
        out = out.transpose(0, 1)
    dy = randn(*out.shape, seed=99)
    out.backward(dy)
    qr, kr, vr = leaf(q.double()), leaf(k.double()), leaf(v.double())
    want = reference(qr, kr, vr, want_mask)
    want.backward(dy.double())
    report.close(f"{name} output", out, want, **TOL)
    for what, got, ref in (("q", qs, qr), ("k", ks, kr), ("v", vs, vr)):
        report.close(f"{name} d{what}", got.grad, ref.grad, **TOL)


def check_masks(report: Report) -> None:
    report.topic = "masks"
    layer = DotProductAttention(H, D, num_gqa_groups=HKV)
    q, k, v = inputs()
    pad = torch.zeros(B, 1, 1, SQ, dtype=torch.bool)
    pad[1, ..., 5:] = True  # sequence 1 is 5 long
    pair = pad.view(B, 1, SQ, 1) | pad
    arbitrary = randn(B, 1, SQ, SQ, seed=7) > 0.5
    ignored = torch.ones(B, 1, SQ, SQ, dtype=torch.bool)  # megatron-core passes a mask anyway
    cu = torch.tensor([0, 8, 13])
    cases = [
        ("no_mask", None, ignored, {}),
        ("causal", causal(SQ, SQ), ignored, {}),
        ("padding", pair, pad, {}),
        ("padding_causal", pair | causal(SQ, SQ), pad, {}),
        ("padding,causal", pair | causal(SQ, SQ), None, {"cu_seqlens_q": cu}),
        ("arbitrary", arbitrary, arbitrary, {}),
        ("causal", causal(SQ, SQ) | ~causal(SQ, SQ, -3), None, {"window_size": (2, 0)}),
        ("no_mask", causal(SQ, SQ, 1) | ~causal(SQ, SQ, -2), None, {"window_size": (1, 1)}),
    ]
    for mask_type, want, given, call in cases:
        for fmt in ("sbhd", "bshd"):
            name = f"{mask_type} {fmt} {call.keys() or ''}"
            compare(report, name, layer, q, k, v, want, fmt, attention_mask=given,
                    attn_mask_type=mask_type, **call)  # fmt: skip
    cross = DotProductAttention(H, D, num_gqa_groups=HKV, attention_type="cross")
    q4 = randn(4, B, H, D, seed=11)
    for mask_type, want in (("causal", causal(4, SQ)), ("causal_bottom_right", causal(4, SQ, 4))):
        compare(report, f"cross {mask_type}", cross, q4, k, v, want, attn_mask_type=mask_type)
    # packed sequences: lengths 3 and 4 starting at tokens 0 and 4 of 10 (padding between)
    lengths, starts = [3, 4], [0, 4]
    cu = torch.tensor([0, 3, 7])
    padded = torch.tensor([0, 4, 10])
    qt, kt, vt = (leaf(randn(10, heads, D, seed=40 + i)) for i, heads in enumerate((H, HKV, HKV)))
    packing = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                   cu_seqlens_kv_padded=padded)  # fmt: skip
    out = layer(qt, kt, vt, qkv_format="thd", attn_mask_type="padding_causal", **packing)
    dy = randn(*out.shape, seed=43)
    out.backward(dy)
    want, grads = torch.zeros(10, H * D, dtype=torch.float64), []
    for start, n in zip(starts, lengths):
        parts = [leaf(x[start : start + n].double().unsqueeze(1)) for x in (qt, kt, vt)]
        got = reference(*parts, causal(n, n)).squeeze(1)
        got.backward(dy[start : start + n].double())
        want[start : start + n] = got.detach()
        grads.append(parts)
    report.close("thd output (padding tokens zero)", out, want, **TOL)
    for (start, n), parts in zip(zip(starts, lengths), grads):
        for what, x, ref in zip("qkv", (qt, kt, vt), parts):
            report.close(f"thd d{what} of sequence at {start}", x.grad[start : start + n],
                         ref.grad.squeeze(1), **TOL)  # fmt: skip
    report.true("thd padding gets no gradient", bool((qt.grad[3] == 0).all()))
    # key heads of 12 channels, value heads of 8 (multi-latent attention's shape)
    mla = DotProductAttention(H, (12, 8), num_gqa_groups=HKV)
    qm, km = randn(SQ, B, H, 12, seed=50), randn(SQ, B, HKV, 12, seed=51)
    compare(report, "value heads smaller than key heads", mla, qm, km, v, causal(SQ, SQ))
    with_max = DotProductAttention(H, D, num_gqa_groups=HKV, return_max_logit=True)
    for mask_type, want_mask, given in (("causal", causal(SQ, SQ), None), ("padding", pair, pad)):
        out, got = with_max(q, k, v, attention_mask=given, attn_mask_type=mask_type)
        kr = k.double().repeat_interleave(H // HKV, 2)
        scores = torch.einsum("ibhd,jbhd->bhij", q.double(), kr) / math.sqrt(D)
        want = scores.masked_fill(want_mask, float("-inf")).amax(dim=(0, 2, 3))
        report.close(f"max_logit {mask_type}", got, want, **TOL)
        report.close(f"max_logit {mask_type} output", out, reference(q, k, v, want_mask), **TOL)
    report.raises(
        "attention bias",
        lambda: layer(q, k, v, core_attention_bias_type="post_scale_bias"),
        "attention bias",
    )


def check_dropout_replay(report: Report) -> None:
    """Dropout draws from the tracker's stream; checkpoint_core_attention replays it."""
    report.topic = "dropout"
    parallel_state.initialize_model_parallel()
    q, k, v = inputs()
    layer = DotProductAttention(H, D, num_gqa_groups=HKV, attention_dropout=0.5,
                                get_rng_state_tracker=get_cuda_rng_tracker)  # fmt: skip
    runs = []
    for recompute in (False, True, False):
        model_parallel_cuda_manual_seed(123)
        qs, ks, vs = leaf(q), leaf(k), leaf(v)
        out = layer(qs, ks, vs, checkpoint_core_attention=recompute)
        out.backward(randn(*out.shape, seed=5))
        runs.append((out.detach(), qs.grad, ks.grad, vs.grad))
    for i, what in enumerate(("output", "dq", "dk", "dv")):
        report.close(f"checkpointed {what} equals", runs[1][i], runs[0][i], rtol=0, atol=0)
        report.close(f"reseeded {what} equals", runs[2][i], runs[0][i], rtol=0, atol=0)
    layer.eval()
    plain = layer(q, k, v)
    report.close("eval has no dropout", plain, reference(q, k, v, causal(SQ, SQ)), **TOL)
    report.true("training dropped", not torch.allclose(runs[0][0], plain))


def check_context_parallel(report: Report, cp: int, rank: int) -> None:
    report.topic = "context parallel"
    s = 4 * cp
    q, k, v = inputs(s, s, seed=20)
    want_full = None
    for comm in ("p2p", "all_gather", "a2a"):
        layer = DotProductAttention(H, D, num_gqa_groups=HKV, cp_group=dist.group.WORLD,
                                    cp_comm_type=comm)  # fmt: skip
        for mask_type, mask in (("causal", causal(s, s)), ("no_mask", None)):
            if comm == "a2a" and HKV % cp:
                continue
            qs, ks, vs = (
                leaf(split_for_context_parallel(x, 0, dist.group.WORLD)) for x in (q, k, v)
            )
            out = layer(qs, ks, vs, attn_mask_type=mask_type)
            want_full = reference(q, k, v, mask)
            want = split_for_context_parallel(want_full, 0, dist.group.WORLD)
            report.close(f"{comm} {mask_type} output", out, want, **TOL)
    padded = DotProductAttention(H, D, num_gqa_groups=HKV, cp_group=dist.group.WORLD)
    no_padding = torch.zeros(B, 1, 1, 4, dtype=torch.bool)

    def padding_call():
        padded(q[:4], k[:4], v[:4], attn_mask_type="padding", attention_mask=no_padding)

    report.raises("padding with CP", padding_call, "context parallelism")


def check_rope(report: Report, rank: int) -> None:
    report.topic = "rope"
    t = randn(SQ, B, H, D, seed=30)
    for interleaved in (False, True):
        freqs = RotaryPositionEmbedding(D, interleaved=interleaved)(SQ)
        x = t.double()
        half = D // 2
        angle = freqs.double()
        if interleaved:
            x1, x2 = x[..., ::2], x[..., 1::2]
            rotated = torch.stack((-x2, x1), -1).reshape(x.shape)
        else:
            rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        want = x * angle.cos() + rotated * angle.sin()
        fused = apply_rotary_pos_emb(t, freqs, interleaved=interleaved, fused=True)
        report.close(f"fused interleaved={interleaved}", fused, want, **TOL)
        unfused = apply_rotary_pos_emb(t, freqs, interleaved=interleaved)
        report.close(f"unfused interleaved={interleaved}", unfused, want, **TOL)
        bshd = apply_rotary_pos_emb(
            t.transpose(0, 1), freqs, "bshd", interleaved=interleaved, fused=True
        )
        report.close(f"bshd interleaved={interleaved}", bshd.transpose(0, 1), want, **TOL)
    # THD: two packed sequences of 8 and 4, each cut for CP rank 1 of 2 (chunks 1 and 2 of 4)
    freqs = RotaryPositionEmbedding(D)(SQ)
    seqs = [randn(8, H, D, seed=31), randn(4, H, D, seed=32)]
    mine = [torch.cat([s.chunk(4)[1], s.chunk(4)[2]]) for s in seqs]
    cu = torch.tensor([0, 8, 12])
    got = apply_rotary_pos_emb(
        torch.cat(mine), freqs, "thd", fused=True, cu_seqlens=cu, cp_size=2, cp_rank=1
    )
    whole = [apply_rotary_pos_emb(s.unsqueeze(1), freqs, fused=True).squeeze(1) for s in seqs]
    want = torch.cat([torch.cat([w.chunk(4)[1], w.chunk(4)[2]]) for w in whole])
    report.close("thd with cp", got, want, **TOL)
    report.raises(
        "thd without cu_seqlens", lambda: apply_rotary_pos_emb(t, freqs, "thd"), "cu_seqlens"
    )


def attention_checks() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    report = Report()
    if world == 1:
        check_masks(report)
        check_dropout_replay(report)
        check_rope(report, rank)
    else:
        check_context_parallel(report, world, rank)
    return report.result()


@functools.cache
def _results(world_size: int) -> list[dict]:
    return run_distributed(attention_checks, world_size, timeout=240)


@pytest.mark.parametrize("topic", ["masks", "dropout", "rope"])
def test_attention_and_rope_equal_torch(topic):
    assert_topic(_results(1), topic)


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_equals_the_full_sequence(world_size):
    assert_topic(_results(world_size), "context parallel")


def test_constructor_refusals_name_the_feature():
    for kwargs, needle in (
        ({"softmax_type": "learnable"}, "softmax_type"),
        ({"qkv_format": "tbhd"}, "qkv_format"),
        ({"cp_comm_type": "a2a+p2p"}, "hierarchical"),
    ):
        with pytest.raises(MegatronCoreError, match=needle):
            DotProductAttention(**{"num_attention_heads": H, "kv_channels": D, **kwargs})
