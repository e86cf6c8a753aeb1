"""Context-parallel attention (NOTE [ Context parallelism ]) against unsharded attention.

Every rank builds the same full Q, K, V and output gradient from one seed, takes its part with
the load-balanced split, runs context_parallel_attention forward and backward, and gathers the
output and dQ / dK / dV back into sequence order; the reference is plain softmax attention in
fp64 on the full tensors. One launch per world size runs every case (three comm types, causal
or not, GQA or not, two sequence lengths whose chunks are 1 and 3 positions long); the masked
cases run the fused blocks and the unfused ones, each against the reference and against the
other (NOTE [ Fused attention ], rule 3).

Tolerances: fp32 results differ from the fp64 reference by fp32 rounding only; the error is
measured as ||ours - reference|| / ||reference|| and must be <= 2e-6 (fused against unfused:
1e-5, the core's bound). bf16 inputs: the CP result's error must be at most twice the CP=1
(one rank, same function) bf16 error.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.context_parallel import (
    context_parallel_attention,
    cp_positions,
    gather_from_context_parallel,
    get_batch_on_this_cp_rank,
    get_pos_emb_on_this_cp_rank,
    split_for_context_parallel,
)
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed

B, H, D = 2, 8, 8


def _reference(q, k, v, causal, mask=None):
    """fp64 attention on [s, b, h, d] with K/V heads repeated for GQA; ``mask`` [b, 1, s, s]
    True = masked out."""
    q, k, v = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return (s.softmax(-1) @ v).permute(2, 0, 1, 3)


def _error(ours, ref):
    return ((ours.double() - ref).norm() / ref.norm()).item()


def _padding_mask(seq):
    """Key padding: batch row i sees only its first seq - 3 * i - 1 keys (never none)."""
    keep = torch.arange(seq).view(1, 1, 1, seq) < torch.tensor(
        [seq - 3 * i - 1 for i in range(B)]
    ).view(B, 1, 1, 1)
    return (~keep).expand(B, 1, seq, seq).contiguous()


def _case(seq, kv_heads, comm, causal, dtype, group, masked=False, backend="auto", keep=None):
    gen = torch.Generator().manual_seed(seq * 100 + kv_heads)
    q = torch.randn(seq, B, H, D, generator=gen)
    k = torch.randn(seq, B, kv_heads, D, generator=gen)
    v = torch.randn(seq, B, kv_heads, D, generator=gen)
    dout = torch.randn(seq, B, H, D, generator=gen)
    full = [x.clone().double().requires_grad_() for x in (q, k, v)]
    mask = _padding_mask(seq) if masked else None
    ref = _reference(*full, causal, mask)
    ref.backward(dout.double())
    parts = [split_for_context_parallel(x, 0, group).to(dtype).requires_grad_() for x in (q, k, v)]
    rows = None if mask is None else split_for_context_parallel(mask, 2, group)
    out = context_parallel_attention(
        *parts, cp_group=group, cp_comm_type=comm, causal=causal, attention_mask=rows,
        backend=backend,
    )  # fmt: skip
    out.backward(split_for_context_parallel(dout, 0, group).to(dtype))
    gathered = [gather_from_context_parallel(t.detach(), 0, group)
                for t in (out, *(p.grad for p in parts))]  # fmt: skip
    assert out.dtype == dtype and all(p.grad.dtype == dtype for p in parts)
    if keep is not None:
        keep[(comm, causal, masked, backend)] = gathered
    return [_error(g, r) for g, r in zip(gathered, [ref.detach(), *(x.grad for x in full)])]


def _all_cases():
    ps.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    group = ps.get_context_parallel_group()
    cp = group.size()
    results = {}
    for seq in (2 * cp, 6 * cp):
        for kv_heads in (H, H // 2):
            for comm in ("p2p", "all_gather", "a2a"):
                for causal in (True, False):
                    results[(seq, kv_heads, comm, causal)] = _case(
                        seq, kv_heads, comm, causal, torch.float32, group
                    )
    kept = {}  # the fused blocks against the unfused ones (NOTE [ Fused attention ], rule 3)
    for comm in ("p2p", "all_gather", "a2a"):  # a padding mask, with and without causal
        for causal in (True, False):
            for backend in ("fused", "unfused"):
                results[("mask", comm, causal, backend)] = _case(
                    6 * cp, H // 2, comm, causal, torch.float32, group, True, backend, kept
                )
            fused, unfused = (kept[(comm, causal, True, b)] for b in ("fused", "unfused"))
            results[("fused vs unfused", comm, causal)] = [
                _error(f, u.double()) for f, u in zip(fused, unfused)
            ]
    for comm in ("p2p", "all_gather", "a2a"):  # bf16, and the one-rank path as its yardstick
        results[("bf16", comm)] = _case(6 * cp, H // 2, comm, True, torch.bfloat16, group)
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # all ranks, alike
    single = singles[dist.get_rank()]
    results["bf16 cp1"] = _case(6 * cp, H // 2, "p2p", True, torch.bfloat16, single)
    # autocast (bf16) around fp32 inputs: scores and merges stay fp32, the result is the same
    with torch.autocast("cpu", dtype=torch.bfloat16):
        results["autocast"] = _case(6 * cp, H, "p2p", True, torch.float32, group)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_variant_equals_unsharded_attention(world_size):
    for results in run_distributed(_all_cases, world_size, timeout=300):
        for case, errors in results.items():
            if case == "bf16 cp1" or case[0] == "bf16":
                continue
            # fp32 against fp64: rounding only; fused against unfused (both fp32): 1e-5
            bound = 1e-5 if case[0] == "fused vs unfused" else 2e-6
            assert max(errors) <= bound, (case, errors)
        yardstick = max(results["bf16 cp1"])
        assert 0 < yardstick < 0.05
        for comm in ("p2p", "all_gather", "a2a"):
            assert max(results[("bf16", comm)]) <= 2 * yardstick, (comm, results[("bf16", comm)])


# --- the split (no processes: sizes given) -----------------------------------------------------


def test_positions_are_megatrons_load_balanced_chunks():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert torch.cat([cp_positions(16, 4, r) for r in range(4)]).sort().values.tolist() == list(
        range(16)
    )
    with pytest.raises(MegatronCoreError, match=r"sequence length \(10\) must be divisible by"):
        cp_positions(10, 4, 0)


def _split_body():
    ps.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    group = ps.get_context_parallel_group()
    rank, cp = group.rank(), group.size()
    tokens = torch.arange(2 * 16).view(2, 16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    batch = {"tokens": tokens, "labels": tokens + 1, "attention_mask": mask, "loss_mask": None}
    new = get_batch_on_this_cp_rank(batch)  # 0.16.1's signature
    same = get_batch_on_this_cp_rank(batch, False, group)  # 0.19's, positionally
    keyword = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    mine = cp_positions(16, cp, rank)
    assert torch.equal(new["tokens"], tokens[:, mine]) and new["loss_mask"] is None
    assert new["attention_mask"].shape == (2, 1, 16 // cp, 16)
    assert all(torch.equal(new[k], same[k]) and torch.equal(new[k], keyword[k])
               for k in ("tokens", "labels", "attention_mask"))  # fmt: skip
    table = torch.arange(16.0).view(16, 1, 1, 1)  # a RoPE table [s, 1, 1, d]
    assert torch.equal(get_pos_emb_on_this_cp_rank(table, 0).flatten(), mine.float())
    x = torch.arange(16.0).view(16, 1).requires_grad_()
    part = split_for_context_parallel(x, 0)
    whole = gather_from_context_parallel(part * (rank + 1), 0)  # sequence order restored
    owner = torch.cat([torch.full((16 // cp,), r + 1.0) for r in range(cp)])
    order = torch.cat([cp_positions(16, cp, r) for r in range(cp)])
    expected = torch.empty(16)
    expected[order] = owner
    assert torch.equal(whole.flatten(), torch.arange(16.0) * expected)
    whole.sum().backward()
    assert torch.equal(x.grad.flatten()[mine], torch.full((16 // cp,), rank + 1.0))
    try:
        get_batch_on_this_cp_rank(batch, True)
        hybrid = None
    except MegatronCoreError as error:
        hybrid = str(error)
    return hybrid


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_batches_positions_and_the_inverse(world_size):
    for hybrid in run_distributed(_split_body, world_size, timeout=120):
        assert "is_hybrid_cp" in hybrid


def _bad_input(case: str):
    ps.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    q = torch.zeros(4, 1, 4 if case != "heads" else 3, 8)
    k = torch.zeros(4, 1, 4 if case != "heads" else 3, 8)
    if case == "odd":
        q, k = q[:3], k[:3]
    try:
        context_parallel_attention(q, k, k, cp_comm_type="ring" if case == "type" else "a2a")
    except MegatronCoreError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "case, message",
    [("type", r"cp_comm_type \('ring'\) must be one of"), ("odd", r"local sequence length \(3\)"),
     ("heads", r"a2a needs the heads \(3\)")],
)  # fmt: skip
def test_bad_input_is_refused_on_every_rank_before_any_collective(case, message):
    import re

    for text in run_distributed(_bad_input, 4, case, timeout=120):
        assert re.search(message, text), text


# --- saved bytes per rank (NOTE [ Context parallelism ], rule 3) --------------------------------


def _saved_bytes(seq, comm, group):
    """Bytes the attention saves for backward on this rank (saved-tensor hooks)."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(seq, B, H, D, generator=gen) for _ in range(3)]
    parts = [split_for_context_parallel(x, 0, group).requires_grad_() for x in full]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        context_parallel_attention(*parts, cp_group=group, cp_comm_type=comm)
    return sum(total)


def _saved_body():
    ps.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    group = ps.get_context_parallel_group()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    seq = 64 * group.size()
    alone = _saved_bytes(seq, "p2p", singles[dist.get_rank()])
    return alone, {comm: _saved_bytes(seq, comm, group) for comm in ("p2p", "all_gather", "a2a")}


@pytest.mark.parametrize("world_size", [2, 4])
def test_saved_bytes_per_rank_scale_as_one_over_cp(world_size):
    for alone, split in run_distributed(_saved_body, world_size, timeout=120):
        for comm, saved in split.items():
            # Q, K, V, the fp32 output and lse: 1/cp of one rank's; the position indices (8
            # bytes a position, of the whole sequence for all_gather's keys and a2a) are extra
            assert 0.95 <= saved * world_size / alone <= 1.1, (comm, saved, alone)
