"""The attention core (NOTE [ Fused attention ]): torch's fused kernels against the unfused
computation, the named fallback, masks, GQA, and dropout with the RNG streams.

Tolerances: in fp32 the fused kernel and the unfused computation sum the same products in a
different order (the flash kernel's online softmax): 1e-5 relative (||a - b|| / ||b||) is
fp32 rounding with room. In bf16 both are compared with an fp64 computation of the same
attention; the fused error may be at most 1.5 times the unfused path's own bf16 error (the
fused kernel keeps its softmax and sums in fp32, the unfused path rounds the probabilities to
bf16 before the second product, so it is usually the smaller one).
"""

import logging
import math

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.attention import dot_product_attention, kernels_used
from megatron_core.context_parallel import context_parallel_attention, split_for_context_parallel
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron_core.testing import run_distributed

S, B, H, D = 24, 2, 4, 8


def _inputs(kv_heads=H, dtype=torch.float32, seed=0, s=S):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, B, H, D, generator=gen)
    k = torch.randn(s, B, kv_heads, D, generator=gen)
    v = torch.randn(s, B, kv_heads, D, generator=gen)
    grad = torch.randn(s, B, H, D, generator=gen)
    return [x.to(dtype) for x in (q, k, v)], grad.to(dtype)


def _padding(s=S):
    """Batch row 1 sees only its first s - 5 keys; row 0's query 3 sees nothing at all."""
    mask = torch.zeros(B, 1, s, s, dtype=torch.bool)
    mask[1, :, :, s - 5 :] = True
    mask[0, :, 3, :] = True
    return mask


def _run(tensors, grad, **options):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = dot_product_attention(*leaves, **options)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = {
    "causal": {"causal": True},
    "bidirectional": {"causal": False},
    "padding": {"causal": False, "mask": True},
    "padding + causal": {"causal": True, "mask": True},
    "gqa causal": {"causal": True, "kv": H // 2},
    "gqa padding + causal": {"causal": True, "kv": H // 4, "mask": True},
}


def _options(case):
    spec = CASES[case]
    mask = _padding() if spec.get("mask") else None
    return spec.get("kv", H), {"causal": spec["causal"], "attention_mask": mask}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_unfused_in_fp32(case):
    kv, options = _options(case)
    tensors, grad = _inputs(kv)
    fused = _run(tensors, grad, backend="fused", **options)
    unfused = _run(tensors, grad, backend="unfused", **options)
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused, unfused):
        assert _rel(a, b) <= 1e-5, (case, name, _rel(a, b))
    if options["attention_mask"] is not None:  # a query that sees no key: zeros on both paths
        assert fused[0][3, 0].abs().max() == 0 and unfused[0][3, 0].abs().max() == 0


@pytest.mark.parametrize("case", ["causal", "gqa padding + causal"])
def test_bf16_fused_error_is_within_the_unfused_paths_own(case):
    kv, options = _options(case)
    tensors, grad = _inputs(kv)
    exact = _run([t.double() for t in tensors], grad.double(), backend="unfused", **options)
    low = [t.bfloat16() for t in tensors]
    fused = _run(low, grad.bfloat16(), backend="fused", **options)
    unfused = _run(low, grad.bfloat16(), backend="unfused", **options)
    for name, f, u, e in zip(("out", "dq", "dk", "dv"), fused, unfused, exact):
        assert f.dtype == torch.bfloat16
        assert _rel(f, e) <= 1.5 * _rel(u, e), (name, _rel(f, e), _rel(u, e))


def test_autocast_runs_the_fused_kernel_in_bf16():
    tensors, grad = _inputs()
    kernels_used(reset=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _run(tensors, grad, backend="fused")
    assert kernels_used() == {("dot_product_attention", "flash"): 1}
    exact = _run([t.double() for t in tensors], grad.double(), backend="unfused")
    assert fused[0].dtype == torch.bfloat16 and fused[1].dtype == torch.float32
    assert _rel(fused[0], exact[0]) < 2e-2  # bf16 inputs: 8 bits of mantissa


def test_the_fallback_is_named_once_and_fused_can_be_required(caplog):
    tensors, grad = _inputs()
    kernels_used(reset=True)
    with caplog.at_level(logging.WARNING, logger="megatron_core.attention"):
        for _ in range(3):  # dropout: torch's CPU flash kernel has none
            dot_product_attention(*tensors, dropout_p=0.1, where="a test's attention")
    lines = [r.getMessage() for r in caplog.records if "a test's attention" in r.getMessage()]
    assert len(lines) == 1 and "CPU flash kernel has no dropout" in lines[0], lines
    assert kernels_used() == {("a test's attention", "unfused"): 3}
    with pytest.raises(MegatronCoreError, match=r"fused attention backend was asked for, but"):
        dot_product_attention(*tensors, dropout_p=0.1, backend="fused")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"key": torch.zeros(S, B, 3, D), "value": torch.zeros(S, B, 3, D)}, r"heads divisible"),
        ({"value": torch.zeros(S, B, H, D + 1)}, r"must be \[s, b, heads, head_dim\]"),
        ({"attention_mask": torch.zeros(B, 1, S, S)}, r"must be bool"),
        ({"attention_mask": torch.zeros(B, 1, S, S - 1, dtype=torch.bool)}, r"attention_mask"),
        ({"dropout_p": 1.0}, r"dropout_p \(1.0\) must be in \[0, 1\)"),
        ({"backend": "flash2"}, r"attention backend \('flash2'\) must be one of"),
    ],
)
def test_bad_input_is_refused_by_name(change, message):
    (q, k, v), _ = _inputs()
    arguments = {"key": k, "value": v, **change}
    with pytest.raises(MegatronCoreError, match=message):
        dot_product_attention(q, arguments.pop("key"), arguments.pop("value"), **arguments)


# --- dropout and the RNG streams (NOTE [ Fused attention ], rule 4) -----------------------------


def _dropped(cp_comm_type=None):
    """Which probabilities this rank's heads dropped, seen through q = k = 0 (uniform
    probabilities) and v = one-hot positions: out[i, :, :, j] = keep[i, j] / (1 - p) / (i + 1)."""
    s = 8
    v = torch.eye(s).view(s, 1, 1, s).expand(s, B, 2, s).contiguous()
    q = torch.zeros(s, B, 2, s)
    with get_cuda_rng_tracker().fork():
        if cp_comm_type is None:
            out = dot_product_attention(q, q, v, dropout_p=0.5)
        else:
            parts = [split_for_context_parallel(x, 0) for x in (q, q, v)]
            out = context_parallel_attention(*parts, cp_comm_type=cp_comm_type, dropout_p=0.5)
    return out != 0


def _streams_body(cp):
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(11)
    kept = _dropped("p2p" if cp > 1 else None)
    everyone = [torch.empty_like(kept) for _ in range(world)]
    dist.all_gather(everyone, kept.contiguous())
    if cp == 1:  # the causal entries, half of them kept (p = 0.5); the others are zeros
        seen = torch.ones(8, 8, dtype=torch.bool).tril().view(8, 1, 1, 8).expand_as(kept)
        assert 0.25 < kept[seen].float().mean().item() < 0.75 and not kept[~seen].any()
    return parallel_state.get_tensor_model_parallel_rank(), [k.tolist() for k in everyone]


@pytest.mark.parametrize("world_size, cp", [(4, 1), (4, 2)])
def test_tp_shards_draw_different_masks_replicas_the_same(world_size, cp):
    results = run_distributed(_streams_body, world_size, cp, timeout=120)
    tp_ranks = [tp for tp, _ in results]
    masks = results[0][1]
    for i in range(world_size):
        for j in range(i + 1, world_size):
            same_shard = tp_ranks[i] == tp_ranks[j]
            if cp == 1:  # the other two ranks are data-parallel replicas of the same heads
                assert (masks[i] == masks[j]) == same_shard, (i, j)
            elif not same_shard:  # CP ranks hold other queries: only TP shards must differ
                assert masks[i] != masks[j], (i, j)


def _cp_dropout_gradient_body(cp_comm_type):
    """The CP dropout backward against the forward's own directional derivative: the same seed
    gives the same masks on every call (fp64, on the unfused blocks; central differences)."""
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    (q, k, v), grad = _inputs(kv_heads=H // 2, s=16, seed=3, dtype=torch.float64)
    parts = [split_for_context_parallel(x, 0).requires_grad_() for x in (q, k, v)]
    g = split_for_context_parallel(grad, 0)

    def loss(*tensors):
        with torch.random.fork_rng():
            torch.manual_seed(7)
            out = context_parallel_attention(*tensors, cp_comm_type=cp_comm_type, dropout_p=0.3)
        return (out * g).sum()

    loss(*parts).backward()
    directions = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).double()
                  for i, p in enumerate(parts)]  # fmt: skip
    step = 1e-5
    with torch.no_grad():
        plus = loss(*(p + step * d for p, d in zip(parts, directions)))
        minus = loss(*(p - step * d for p, d in zip(parts, directions)))
    numeric = torch.tensor([(plus - minus).item() / (2 * step)], dtype=torch.float64)
    analytic = torch.tensor([sum((p.grad * d).sum().item() for p, d in zip(parts, directions))],
                            dtype=torch.float64)  # fmt: skip
    dist.all_reduce(numeric)
    dist.all_reduce(analytic)
    with torch.no_grad():  # the dropout does drop: the output differs from no dropout
        plain = context_parallel_attention(*parts, cp_comm_type=cp_comm_type)
        dropped = loss(*parts).item() != (plain * g).sum().item()
    return numeric.item(), analytic.item(), dropped


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("cp_comm_type", ["p2p", "all_gather"])
def test_cp_dropout_backward_is_the_forwards_derivative(world_size, cp_comm_type):
    for numeric, analytic, dropped in run_distributed(
        _cp_dropout_gradient_body, world_size, cp_comm_type, timeout=120
    ):
        assert dropped
        # fixed masks make the loss smooth: the central difference is off by ~step^2 (1e-10)
        # plus fp64 rounding of the loss over 2 * step (~1e-16 / 1e-5); 1e-6 leaves room
        assert math.isclose(numeric, analytic, rel_tol=1e-6), (numeric, analytic)


def _a2a_dropout_body():
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    (q, k, v), _ = _inputs()
    parts = [split_for_context_parallel(x, 0) for x in (q, k, v)]
    try:
        context_parallel_attention(*parts, cp_comm_type="a2a", dropout_p=0.1)
    except MegatronCoreError as error:
        return str(error)
    return "no error"


def test_a2a_dropout_is_refused_by_name_on_every_rank():
    for text in run_distributed(_a2a_dropout_body, 2, timeout=120):
        assert "attention dropout (0.1) with cp_comm_type 'a2a' is not supported" in text, text


# --- our GPT on the core ------------------------------------------------------------------------


def _gpt_step(tp, cp, comm, dropout, backend="auto", recompute=False):
    from megatron_core.transformer import GPTModel, TransformerConfig

    model_parallel_cuda_manual_seed(5)
    selective = {"recompute_granularity": "selective"} if recompute else {}
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=comm,
        hidden_dropout=dropout, attention_dropout=dropout, attention_backend=backend, **selective,
    )  # fmt: skip
    model = GPTModel(config, 64, 16)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    labels = torch.randint(0, 64, (2, 16), generator=gen)
    if cp > 1:
        tokens, labels = (split_for_context_parallel(x, 1) for x in (tokens, labels))
    loss = model(tokens, labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _gpt_body(tp, cp, comm):
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )
    problems = []
    # recompute of the core attention with dropout 0.1: bitwise the same (rule 4)
    loss, grads = _gpt_step(tp, cp, comm, 0.1)
    again, again_grads = _gpt_step(tp, cp, comm, 0.1, recompute=True)
    if not torch.equal(loss, again):
        problems.append(f"recompute: loss {again.item()} != {loss.item()}")
    problems += [f"recompute: grad of {n}" for n, g in grads.items()
                 if not torch.equal(g, again_grads[n])]  # fmt: skip
    # fused against unfused without dropout, fp32 (1e-5 as the core's test)
    fused, fused_grads = _gpt_step(tp, cp, comm, 0.0, "fused")
    plain, plain_grads = _gpt_step(tp, cp, comm, 0.0, "unfused")
    if _rel(fused, plain) > 1e-5:
        problems.append(f"fused loss {fused.item()} vs unfused {plain.item()}")
    problems += [f"fused: grad of {n} ({_rel(g, plain_grads[n]):.1e})"
                 for n, g in fused_grads.items() if _rel(g, plain_grads[n]) > 1e-5]  # fmt: skip
    return problems


@pytest.mark.parametrize(
    "world_size, tp, cp, comm", [(2, 2, 1, "p2p"), (2, 1, 2, "p2p"), (2, 1, 2, "all_gather")]
)
def test_gpt_recomputes_attention_dropout_bitwise_and_fused_equals_unfused(
    world_size, tp, cp, comm
):
    for problems in run_distributed(_gpt_body, world_size, tp, cp, comm, timeout=300):
        assert not problems, problems
