"""The stand-in's Transformer Engine modules against unsharded torch references.

Each module is built on 1, 2 and 4 gloo ranks (the world is the tensor-parallel group), its
parameters set to the shards of full tensors drawn from one seed on every rank, and its output
and every gradient (input, weight, bias, norm parameters) compared with the same computation in
plain torch on the full tensors. One per-rank body per world size runs every check and records
it under a topic (``_te_checks.Report``); each test asserts one topic.

Tolerances: fp32 at torch.testing's defaults (rtol 1.3e-6, atol 1e-5): the sharded layers
compute the same products, only summed in another order (per-rank partial sums, then the
reduction). The autocast check compares dtypes and bf16 values at 1e-2 (bf16 keeps 8 bits; an
O(1) value is rounded a few times on the way).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _te_checks import Report, assert_topic, leaf, randn, shard

from megatron_core.testing import run_distributed
from megatron_core.transformer_engine.pytorch import (
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
)

S, B, IN, OUT, FFN = 8, 2, 8, 16, 8  # divisible by 4, the largest group
WORLD_SIZES = (1, 2, 4)


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


def _reference_norm(x, weight, bias, normalization, eps=1e-5, zero_centered=False):
    gamma = weight + 1 if zero_centered else weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)


def _sum_partial(grad: torch.Tensor, group) -> torch.Tensor:
    """A sequence-parallel parameter's gradient summed over the group (finalize_model_grads)."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def check_linear(report: Report, tp: int, rank: int, group) -> None:
    report.topic = "Linear"
    w, b = randn(OUT, IN, seed=1), randn(OUT, seed=2)
    x, dy = randn(S, B, IN, seed=3), randn(S, B, OUT, seed=4)
    variants = [(None, False), ("column", False), ("row", False)]
    if tp > 1:
        variants += [("column", True), ("row", True)]
    for mode, sp in variants:
        for bias, return_bias in ((True, False), (True, True), (False, False)):
            name = f"mode={mode} sp={sp} bias={bias} return_bias={return_bias}"
            layer = Linear(
                IN, OUT, sequence_parallel=sp, tp_group=group if mode else None,
                bias=bias, return_bias=return_bias, parallel_mode=mode, device="cpu",
            )  # fmt: skip
            col, row = mode == "column", mode == "row"
            _copy(
                layer.weight, shard(w, 0, tp, rank) if col else shard(w, 1, tp, rank) if row else w
            )
            if bias:
                _copy(layer.bias, shard(b, 0, tp, rank) if col else b)
            x_in = leaf(
                shard(x, 0, tp, rank) if col and sp else shard(x, -1, tp, rank) if row else x
            )
            out = layer(x_in)
            if return_bias:
                out = out[0] + out[1]
            want_dy = (
                shard(dy, -1, tp, rank) if col else shard(dy, 0, tp, rank) if row and sp else dy
            )
            out.backward(want_dy)
            x_ref, w_ref = leaf(x), leaf(w)
            b_ref = leaf(b) if bias else None
            y = F.linear(x_ref, w_ref, b_ref)
            y.backward(dy)
            want = shard(y, -1, tp, rank) if col else shard(y, 0, tp, rank) if row and sp else y
            report.close(f"{name} output", out, want)
            want_dx = x_ref.grad
            if col and sp:
                want_dx = shard(want_dx, 0, tp, rank)
            elif row:
                want_dx = shard(want_dx, -1, tp, rank)
            report.close(f"{name} input grad", x_in.grad, want_dx)
            dw = (
                shard(w_ref.grad, 0, tp, rank)
                if col
                else shard(w_ref.grad, 1, tp, rank)
                if row
                else w_ref.grad
            )
            report.close(f"{name} weight grad", layer.weight.grad, dw)
            report.true(
                f"{name} weight marks",
                layer.weight.tensor_model_parallel
                and layer.weight.partition_dim == (1 if row else 0),
            )
            if bias:
                db = layer.bias.grad
                if row and sp:
                    report.true(f"{name} bias sequence_parallel", layer.bias.sequence_parallel)
                    db = _sum_partial(db, group)
                report.close(
                    f"{name} bias grad", db, shard(b_ref.grad, 0, tp, rank) if col else b_ref.grad
                )
            else:
                report.true(
                    f"{name} no bias parameter", "bias" not in dict(layer.named_parameters())
                )


def check_layernorm_linear(report: Report, tp: int, rank: int, group) -> None:
    report.topic = "LayerNormLinear"
    w, b = randn(OUT, IN, seed=5), randn(OUT, seed=6)
    gamma, beta = 1 + 0.1 * randn(IN, seed=7), randn(IN, seed=8)
    x, dy = randn(S, B, IN, seed=9), randn(S, B, OUT, seed=10)
    for normalization in ("LayerNorm", "RMSNorm"):
        for sp in (False, True) if tp > 1 else (False,):
            for zero_centered in (False, True):
                name = f"{normalization} sp={sp} zero_centered_gamma={zero_centered}"
                layer = LayerNormLinear(
                    IN, OUT, sequence_parallel=sp, tp_group=group, normalization=normalization,
                    parallel_mode="column", return_layernorm_output=True,
                    zero_centered_gamma=zero_centered, device="cpu",
                )  # fmt: skip
                report.true(
                    f"{name} norm initialized",
                    bool((layer.layer_norm_weight == (0.0 if zero_centered else 1.0)).all()),
                )
                scale = gamma - 1 if zero_centered else gamma
                _copy(layer.layer_norm_weight, scale)
                if normalization == "LayerNorm":
                    _copy(layer.layer_norm_bias, beta)
                _copy(layer.weight, shard(w, 0, tp, rank))
                _copy(layer.bias, shard(b, 0, tp, rank))
                x_in = leaf(shard(x, 0, tp, rank) if sp else x)
                out, ln_out = layer(x_in)
                out.backward(shard(dy, -1, tp, rank))
                x_ref, g_ref, w_ref, b_ref = leaf(x), leaf(scale), leaf(w), leaf(b)
                beta_ref = leaf(beta) if normalization == "LayerNorm" else None
                ln_ref = _reference_norm(
                    x_ref, g_ref, beta_ref, normalization, zero_centered=zero_centered
                )
                y = F.linear(ln_ref, w_ref, b_ref)
                y.backward(dy)
                report.close(f"{name} output", out, shard(y, -1, tp, rank))
                report.close(
                    f"{name} norm output", ln_out, shard(ln_ref, 0, tp, rank) if sp else ln_ref
                )
                report.close(
                    f"{name} input grad",
                    x_in.grad,
                    shard(x_ref.grad, 0, tp, rank) if sp else x_ref.grad,
                )
                report.close(
                    f"{name} weight grad", layer.weight.grad, shard(w_ref.grad, 0, tp, rank)
                )
                dg = layer.layer_norm_weight.grad
                report.true(
                    f"{name} norm sequence_parallel",
                    layer.layer_norm_weight.sequence_parallel == sp,
                )
                report.close(
                    f"{name} norm weight grad", _sum_partial(dg, group) if sp else dg, g_ref.grad
                )
                if beta_ref is not None:
                    db = layer.layer_norm_bias.grad
                    report.close(
                        f"{name} norm bias grad",
                        _sum_partial(db, group) if sp else db,
                        beta_ref.grad,
                    )


def check_layernorm_mlp(report: Report, tp: int, rank: int, group) -> None:
    report.topic = "LayerNormMLP"
    x, dy = randn(S, B, IN, seed=11), randn(S, B, IN, seed=12)
    for activation, rows in (("gelu", FFN), ("swiglu", 2 * FFN)):
        for sp in (False, True) if tp > 1 else (False,):
            name = f"{activation} sp={sp}"
            fc1_w, fc1_b = randn(rows, IN, seed=13), randn(rows, seed=14)
            fc2_w, fc2_b = randn(IN, FFN, seed=15), randn(IN, seed=16)
            layer = LayerNormMLP(
                IN, FFN, sequence_parallel=sp, tp_group=group, activation=activation,
                set_parallel_mode=True, device="cpu",
            )  # fmt: skip
            if activation == "swiglu":  # each rank holds its [gate; linear] rows
                gate, lin = fc1_w.chunk(2), fc1_b.chunk(2)
                mine = torch.cat([shard(gate[0], 0, tp, rank), shard(gate[1], 0, tp, rank)])
                mine_b = torch.cat([shard(lin[0], 0, tp, rank), shard(lin[1], 0, tp, rank)])
            else:
                mine, mine_b = shard(fc1_w, 0, tp, rank), shard(fc1_b, 0, tp, rank)
            _copy(layer.fc1_weight, mine)
            _copy(layer.fc1_bias, mine_b)
            _copy(layer.fc2_weight, shard(fc2_w, 1, tp, rank))
            _copy(layer.fc2_bias, fc2_b)
            x_in = leaf(shard(x, 0, tp, rank) if sp else x)
            out = layer(x_in)
            out.backward(shard(dy, 0, tp, rank) if sp else dy)
            x_ref = leaf(x)
            h = F.linear(F.layer_norm(x_ref, (IN,)), fc1_w, fc1_b)
            if activation == "swiglu":
                g, v = h.chunk(2, dim=-1)
                h = F.silu(g) * v
            else:
                h = F.gelu(h, approximate="tanh")
            y = F.linear(h, fc2_w, fc2_b)
            y.backward(dy)
            report.close(f"{name} output", out, shard(y, 0, tp, rank) if sp else y)
            report.close(
                f"{name} input grad",
                x_in.grad,
                shard(x_ref.grad, 0, tp, rank) if sp else x_ref.grad,
            )
            names = [n for n, _ in layer.named_parameters()]
            report.true(f"{name} parameter names", names == [
                "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight",
                "fc2_bias",
            ], str(names))  # fmt: skip


def check_grouped_linear(report: Report, rank: int) -> None:
    report.topic = "GroupedLinear"
    splits = [3, 0, 5]
    weights = [randn(OUT, IN, seed=20 + i) for i in range(3)]
    biases = [randn(OUT, seed=30 + i) for i in range(3)]
    x, dy = randn(sum(splits), IN, seed=17), randn(sum(splits), OUT, seed=18)
    layer = GroupedLinear(3, IN, OUT, device="cpu")
    for i in range(3):
        _copy(getattr(layer, f"weight{i}"), weights[i])
        _copy(getattr(layer, f"bias{i}"), biases[i])
    x_in = leaf(x)
    out = layer(x_in, splits)
    out.backward(dy)
    refs = [leaf(w) for w in weights]
    outs, start = [], 0
    for i, rows in enumerate(splits):
        outs.append(F.linear(x[start : start + rows], refs[i], biases[i]))
        start += rows
    torch.cat(outs).backward(dy)
    report.close("output", out, torch.cat(outs))
    for i in range(3):
        report.close(f"weight{i} grad", getattr(layer, f"weight{i}").grad, refs[i].grad)
    names = [n for n, _ in layer.named_parameters()]
    report.true("names", names == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"])
    report.raises("bad m_splits", lambda: layer(x_in, [8, 0]), "m_splits", "3 non-negative")


def check_fused_wgrad(report: Report, tp: int, rank: int, group) -> None:
    """NOTE [ Transformer Engine linear ], rule 4, column-parallel under sequence parallelism."""
    report.topic = "fuse_wgrad_accumulation"
    w, x, dy = randn(OUT, IN, seed=40), randn(S, B, IN, seed=41), randn(S, B, OUT, seed=42)
    sp = tp > 1
    layer = Linear(
        IN, OUT, sequence_parallel=sp, tp_group=group, parallel_mode="column", bias=False,
        fuse_wgrad_accumulation=True, device="cpu",
    )  # fmt: skip
    _copy(layer.weight, shard(w, 0, tp, rank))
    layer.weight.main_grad = torch.full_like(layer.weight, 7.0)
    layer.weight.grad_added_to_main_grad = False
    x_ref = leaf(x)
    F.linear(x_ref, leaf(w)).backward(dy)
    want = shard(torch.einsum("sbo,sbi->oi", dy, x), 0, tp, rank)

    def step(first):
        layer(shard(x, 0, tp, rank) if sp else x, is_first_microbatch=first).backward(
            shard(dy, -1, tp, rank)
        )

    step(True)  # the first microbatch writes over main_grad
    report.close("first microbatch overwrites", layer.weight.main_grad, want)
    report.true("grad_added_to_main_grad", layer.weight.grad_added_to_main_grad is True)
    report.true("a dummy gradient reaches .grad", layer.weight.grad is not None)
    step(False)
    report.close("later microbatch accumulates", layer.weight.main_grad, 2 * want)
    plain = Linear(IN, OUT, bias=False, fuse_wgrad_accumulation=True, device="cpu")
    plain.weight.main_grad = torch.zeros_like(plain.weight)
    plain(x).sum().backward()
    report.true("without DDP's mark no gradient reaches .grad", plain.weight.grad is None)
    del plain.weight.main_grad
    report.raises("main_grad missing", lambda: plain(x), "main_grad")


def check_norms_and_autocast(report: Report, rank: int) -> None:
    report.topic = "norms"
    x = randn(S, B, IN, seed=50)
    for cls, torch_norm in (
        (LayerNorm, torch.nn.LayerNorm(IN)),
        (RMSNorm, torch.nn.RMSNorm(IN, eps=1e-5)),
    ):
        norm = cls(IN, sequence_parallel=True, device="cpu")
        report.true(f"{cls.__name__} marks", all(p.sequence_parallel for p in norm.parameters()))
        report.close(f"{cls.__name__} output", norm(x), torch_norm(x), rtol=0, atol=0)
        state = norm.state_dict()
        report.true(
            f"{cls.__name__} extra state",
            state["_extra_state"].dtype == torch.uint8 and state["_extra_state"].numel() == 0,
        )
    report.topic = "autocast"
    layer = LayerNormLinear(IN, OUT, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        normed = LayerNorm(IN, device="cpu")(x)
        from_bf16 = layer(x.bfloat16())  # a bf16 input with fp32 parameters: autocast decides
    report.true("a bf16 input runs under autocast", from_bf16.dtype == torch.bfloat16)
    report.true("LayerNormLinear output is bf16", out.dtype == torch.bfloat16)
    report.true("LayerNorm output is bf16", normed.dtype == torch.bfloat16)
    want = F.linear(
        F.layer_norm(x, (IN,), layer.layer_norm_weight, layer.layer_norm_bias),
        layer.weight,
        layer.bias,
    )
    report.close("bf16 values", out, want, rtol=1e-2, atol=1e-2)
    report.raises("dtype mismatch outside autocast", lambda: layer(x.double()), "dtype")


def module_checks() -> dict:
    """Every check on this rank; the world is the tensor-parallel group."""
    tp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    report = Report()
    check_linear(report, tp, rank, group)
    check_layernorm_linear(report, tp, rank, group)
    check_layernorm_mlp(report, tp, rank, group)
    check_grouped_linear(report, rank)
    check_fused_wgrad(report, tp, rank, group)
    check_norms_and_autocast(report, rank)
    return report.result()


@functools.cache
def _results(world_size: int) -> list[dict]:
    return run_distributed(module_checks, world_size, timeout=240)


TOPICS = (
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "GroupedLinear",
    "fuse_wgrad_accumulation",
    "norms",
    "autocast",
)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("topic", TOPICS)
def test_module_equals_torch_reference(topic, world_size):
    assert_topic(_results(world_size), topic)
