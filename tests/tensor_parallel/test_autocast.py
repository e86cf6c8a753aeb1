"""The tensor-parallel layers under torch.autocast (bf16 and fp16): forward, backward, recompute.

Every check runs the parallel layer and the serial torch module (nn.Linear / nn.Embedding /
F.cross_entropy, built from the same full weight) under the SAME ``torch.autocast`` region, then
runs backward outside it, as a training loop does. Outputs must have the reference's dtype, and
outputs and gradients must agree. Autocast's device type is the device the tests run on
(``cpu`` here; ``cuda`` in the harness's CUDA mode, see megatron_core.testing).

Tolerances (rtol = atol, against the reference under the same autocast):
- bf16: 4e-2. Both sides round the matmul's inputs to bf16 identically and accumulate in fp32;
  the parallel side additionally rounds its per-rank partial sums to bf16 before the all-reduce /
  reduce-scatter (one rounding per rank, up to 4, each <= 2^-9 relative = 2e-3 of an O(1) partial
  sum, which here is at most ~4 in magnitude: <= 4 * 4 * 2e-3 = 3.2e-2 absolute).
- fp16: 1e-2, the same argument with fp16's 2^-12 relative rounding (8x finer) plus headroom
  for the cross-entropy's exp of fp16 logits.
- checkpoint recompute vs the same computation without checkpoint: exact. The recompute replays
  the forward's autocast state, so it runs the same kernels on the same values; a recompute in
  another dtype would differ in the last bits or fail on a dtype mismatch.
One per-rank body records failures by topic (never raising mid-collective); each test asserts
one topic for one world size.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from _tp_reference import Report, full_weight, init_method, leaf, shard

from megatron_core import device
from megatron_core import parallel_state as ps
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel import checkpoint, vocab_parallel_cross_entropy
from megatron_core.tensor_parallel import mappings as M
from megatron_core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron_core.testing import run_distributed

WORLD_SIZES = (1, 2, 4)
DTYPES = (torch.bfloat16, torch.float16)
SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 8, 16, 32  # all divisible by 4, the largest TP size
SEED = 2024
TOL = {torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}, torch.float16: {"rtol": 1e-2, "atol": 1e-2}}
EXACT = {"rtol": 0, "atol": 0}
TOPICS = (
    "column",
    "row",
    "linear_function",
    "embedding",
    "cross_entropy",
    "checkpoint",
    "params",
    "mappings",
)


def randn(*shape, seed):
    dev = device.current_device()
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dev)


def config(tp, sp=False, **kwargs):
    return ModelParallelConfig(
        tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True, **kwargs
    )


def linear_ref(in_size, out_size, seed, bias=None, dtype=torch.float32):
    ref = torch.nn.Linear(in_size, out_size, bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(full_weight(out_size, in_size, seed))
        if bias is not None:
            ref.bias.copy_(bias)
    return ref.to(device.current_device())


def autocast(dtype):
    return torch.autocast(device.device_type(), dtype=dtype)


def check_column(report, tp, rank, dtype):
    x, dy = randn(SEQ, BATCH, HIDDEN, seed=1), randn(SEQ, BATCH, FFN, seed=2)
    bias = randn(FFN, seed=3)
    variants = [(False, False, False), (False, True, False), (False, False, True)]
    if tp > 1:  # (sequence_parallel, async allreduce, gather_output)
        variants += [(True, False, False), (True, False, True)]
    for sp, overlap, gather in variants:
        name = f"{dtype} sp={sp} async={overlap} gather={gather}"
        cfg = config(tp, sp, async_tensor_model_parallel_allreduce=overlap)
        torch.manual_seed(SEED)
        layer = ColumnParallelLinear(
            HIDDEN, FFN, config=cfg, init_method=init_method, gather_output=gather
        ).to(device.current_device())
        with torch.no_grad():
            layer.bias.copy_(shard(bias, 0, tp, rank))
        x_in = leaf(shard(x, 0, tp, rank) if sp else x)
        ref, x_ref = linear_ref(HIDDEN, FFN, SEED, bias), leaf(x)
        with autocast(dtype):
            out, _ = layer(x_in)
            y_ref = ref(x_ref)
        out.backward((dy if gather else shard(dy, -1, tp, rank)).to(out.dtype))
        y_ref.backward(dy.to(y_ref.dtype))
        report.close(
            f"{name} output", out, y_ref if gather else shard(y_ref, -1, tp, rank), TOL[dtype]
        )
        dx = shard(x_ref.grad, 0, tp, rank) if sp else x_ref.grad
        report.close(f"{name} input grad", x_in.grad, dx, TOL[dtype])
        dw, db = shard(ref.weight.grad, 0, tp, rank), shard(ref.bias.grad, 0, tp, rank)
        report.close(f"{name} weight grad", layer.weight.grad, dw, TOL[dtype])
        report.close(f"{name} bias grad", layer.bias.grad, db, TOL[dtype])


def check_row(report, tp, rank, dtype):
    x, dy = randn(SEQ, BATCH, FFN, seed=4), randn(SEQ, BATCH, HIDDEN, seed=5)
    bias = randn(HIDDEN, seed=6)
    variants = [(False, True, True), (False, False, True), (False, True, False)]
    if tp > 1:  # (sequence_parallel, input_is_parallel, bias)
        variants += [(True, True, True)]
    for sp, parallel_input, has_bias in variants:
        name = f"{dtype} sp={sp} input_is_parallel={parallel_input} bias={has_bias}"
        torch.manual_seed(SEED)
        layer = RowParallelLinear(
            FFN, HIDDEN, config=config(tp, sp), init_method=init_method, bias=has_bias,
            input_is_parallel=parallel_input, skip_bias_add=False,
        ).to(device.current_device())  # fmt: skip
        if has_bias:
            with torch.no_grad():
                layer.bias.copy_(bias)
        x_in = leaf(shard(x, -1, tp, rank) if parallel_input else x)
        ref, x_ref = linear_ref(FFN, HIDDEN, SEED, bias if has_bias else None), leaf(x)
        with autocast(dtype):
            out, _ = layer(x_in)
            y_ref = ref(x_ref)
        out.backward((shard(dy, 0, tp, rank) if sp else dy).to(out.dtype))
        y_ref.backward(dy.to(y_ref.dtype))
        allreduce_sequence_parallel_grads(layer)
        report.close(f"{name} output", out, shard(y_ref, 0, tp, rank) if sp else y_ref, TOL[dtype])
        dx = shard(x_ref.grad, -1, tp, rank) if parallel_input else x_ref.grad
        report.close(f"{name} input grad", x_in.grad, dx, TOL[dtype])
        dw = shard(ref.weight.grad, 1, tp, rank)
        report.close(f"{name} weight grad", layer.weight.grad, dw, TOL[dtype])
        if has_bias:
            report.close(f"{name} bias grad", layer.bias.grad, ref.bias.grad, TOL[dtype])


def check_linear_function(report, tp, rank, dtype):
    """The function with bias=None (it once crashed there) and with the fused main_grad path."""
    x, dy = randn(SEQ, BATCH, HIDDEN, seed=7), randn(SEQ, BATCH, FFN // tp, seed=8)
    weight = shard(full_weight(FFN, HIDDEN, SEED).to(device.current_device()), 0, tp, rank)
    for fusion in (False, True):
        name = f"{dtype} fusion={fusion}"
        w, x_in = leaf(weight), leaf(x)
        if fusion:
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
        w_ref, x_ref = leaf(weight), leaf(x)
        with autocast(dtype):
            out = linear_with_grad_accumulation_and_async_allreduce(
                x_in, w, None, fusion, False, False
            )
            y_ref = F.linear(x_ref, w_ref)
        out.backward(dy.to(out.dtype))
        y_ref.backward(dy.to(y_ref.dtype))
        report.close(f"{name} output", out, y_ref, TOL[dtype])
        report.close(f"{name} input grad", x_in.grad, x_ref.grad, TOL[dtype])
        # fp32 main_grad accumulates the same bf16/fp16 products exactly (NOTE [ Overlapped
        # linear backward ], rule 4, in linear/autograd.py); the reference's weight grad is
        # rounded to the autocast dtype before its fp32 cast.
        report.close(
            f"{name} weight grad", w.main_grad if fusion else w.grad, w_ref.grad, TOL[dtype]
        )


def check_embedding(report, tp, rank, dtype):
    """VocabParallelEmbedding feeding an autocast linear, as the first layer of a model does."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    ids = ids.to(device.current_device())
    dy = randn(BATCH, SEQ, FFN, seed=10)
    fc_weight = full_weight(FFN, HIDDEN, SEED + 1).to(device.current_device())
    for scatter in (False, True) if tp > 1 else (False,):
        name = f"{dtype} reduce_scatter={scatter}"
        torch.manual_seed(SEED)
        layer = VocabParallelEmbedding(
            VOCAB, HIDDEN, init_method=init_method, config=config(tp),
            reduce_scatter_embeddings=scatter,
        ).to(device.current_device())  # fmt: skip
        ref = torch.nn.Embedding(VOCAB, HIDDEN).to(device.current_device())
        with torch.no_grad():
            ref.weight.copy_(full_weight(VOCAB, HIDDEN, SEED))
        with autocast(dtype):
            out = F.linear(layer(ids), fc_weight)
            y_ref = F.linear(ref(ids), fc_weight)
        # Reduce-scatter turns [b, s, h] into this rank's rows of [s, b, h].
        rows = (lambda t: shard(t.transpose(0, 1), 0, tp, rank)) if scatter else (lambda t: t)
        out.backward(rows(dy).to(out.dtype))
        y_ref.backward(dy.to(y_ref.dtype))
        report.close(f"{name} output", out, rows(y_ref), TOL[dtype])
        dw = shard(ref.weight.grad, 0, tp, rank)
        report.close(f"{name} weight grad", layer.weight.grad, dw, TOL[dtype])


def check_cross_entropy(report, tp, rank, dtype):
    """bf16/fp16 logits from an autocast ColumnParallelLinear -> fp32 vocab-parallel loss."""
    x = randn(SEQ, BATCH, HIDDEN, seed=11)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(12))
    target = target.to(device.current_device())
    torch.manual_seed(SEED)
    head = ColumnParallelLinear(
        HIDDEN, VOCAB, config=config(tp), init_method=init_method, bias=False
    ).to(device.current_device())
    ref, x_in, x_ref = linear_ref(HIDDEN, VOCAB, SEED), leaf(x), leaf(x)
    with autocast(dtype):
        logits, _ = head(x_in)
        loss = vocab_parallel_cross_entropy(logits, target)
        ref_logits = ref(x_ref)
        ref_loss = F.cross_entropy(
            ref_logits.float().flatten(0, 1), target.flatten(), reduction="none"
        ).view_as(target)
    report.true(f"{dtype} logits are {dtype}", logits.dtype == dtype)
    report.close(f"{dtype} loss (fp32)", loss, ref_loss, TOL[dtype])
    loss.mean().backward()
    ref_loss.mean().backward()
    report.close(f"{dtype} input grad", x_in.grad, x_ref.grad, TOL[dtype])
    dw = shard(ref.weight.grad, 0, tp, rank)
    report.close(f"{dtype} weight grad", head.weight.grad, dw, TOL[dtype])


def _mlp(fc1, fc2, x):
    h, _ = fc1(x)
    out, _ = fc2(F.gelu(h))
    return out


def check_checkpoint(report, tp, rank, dtype):
    """A checkpointed Column -> gelu -> Row under autocast, backward outside it, equals the
    same computation without checkpoint exactly (the recompute replays autocast)."""
    x, dy = randn(SEQ, BATCH, HIDDEN, seed=13), randn(SEQ, BATCH, HIDDEN, seed=14)
    for sp in (False, True) if tp > 1 else (False,):
        for reentrant in (True, False):
            name = f"{dtype} sp={sp} reentrant={reentrant}"
            grads = []
            for use_checkpoint in (False, True):
                torch.manual_seed(SEED)
                fc1 = ColumnParallelLinear(
                    HIDDEN, FFN, config=config(tp, sp), init_method=init_method
                ).to(device.current_device())
                fc2 = RowParallelLinear(
                    FFN, HIDDEN, config=config(tp, sp), init_method=init_method, bias=True,
                    input_is_parallel=True, skip_bias_add=False,
                ).to(device.current_device())  # fmt: skip
                x_in = leaf(shard(x, 0, tp, rank) if sp else x)
                fn = functools.partial(_mlp, fc1, fc2)
                with autocast(dtype):
                    if use_checkpoint:
                        out = checkpoint(fn, False, x_in, use_reentrant=reentrant)
                    else:
                        out = fn(x_in)
                out.backward((shard(dy, 0, tp, rank) if sp else dy).to(out.dtype))
                grads.append([out, x_in.grad, fc1.weight.grad, fc2.weight.grad, fc2.bias.grad])
            for what, got, want in zip(("output", "dx", "dw1", "dw2", "db2"), grads[1], grads[0]):
                report.close(f"{name} {what}", got, want, EXACT)


def check_params(report, tp, rank, dtype):
    """--bf16/--fp16 layers: params in the low dtype, low-dtype input, fp32 main_grad fusion."""
    x, dy = randn(SEQ, BATCH, HIDDEN, seed=15), randn(SEQ, BATCH, HIDDEN, seed=16)
    for sp in (False, True) if tp > 1 else (False,):
        name = f"{dtype} params sp={sp}"
        cfg = config(tp, sp, params_dtype=dtype, gradient_accumulation_fusion=True)
        torch.manual_seed(SEED)
        fc1 = ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=init_method)
        torch.manual_seed(SEED + 1)
        fc2 = RowParallelLinear(
            FFN, HIDDEN, config=cfg, init_method=init_method, bias=True,
            input_is_parallel=True, skip_bias_add=False,
        )  # fmt: skip
        for layer in (fc1, fc2):
            layer.to(device.current_device())
            layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
        ref1 = linear_ref(HIDDEN, FFN, SEED, torch.zeros(FFN), dtype)
        ref2 = linear_ref(FFN, HIDDEN, SEED + 1, torch.zeros(HIDDEN), dtype)
        x_in = leaf(shard(x, 0, tp, rank) if sp else x).to(dtype)
        x_ref = leaf(x.to(dtype))
        x_in.retain_grad()
        with autocast(dtype):
            out = _mlp(fc1, fc2, x_in)
            y_ref = ref2(F.gelu(ref1(x_ref)))
        out.backward((shard(dy, 0, tp, rank) if sp else dy).to(out.dtype))
        y_ref.backward(dy.to(y_ref.dtype))
        allreduce_sequence_parallel_grads(torch.nn.ModuleList([fc1, fc2]))
        report.close(f"{name} output", out, shard(y_ref, 0, tp, rank) if sp else y_ref, TOL[dtype])
        dw1 = shard(ref1.weight.grad, 0, tp, rank).float()
        dw2 = shard(ref2.weight.grad, 1, tp, rank).float()
        report.close(f"{name} fc1 main_grad", fc1.weight.main_grad, dw1, TOL[dtype])
        report.close(f"{name} fc2 main_grad", fc2.weight.main_grad, dw2, TOL[dtype])
        report.close(f"{name} fc2 bias grad", fc2.bias.grad, ref2.bias.grad, TOL[dtype])


def _sp_round_trip(h, group):
    shard = M.scatter_to_sequence_parallel_region(h, group=group)
    return M.gather_from_sequence_parallel_region(shard, False, group=group)


def _all_to_all_round_trip(h, group):
    shard = M.scatter_to_sequence_parallel_region(h, group=group)
    hp = M.all_to_all_sp2hp(shard.reshape(-1, shard.shape[-1]), group=group)
    back = M.all_to_all_hp2sp(hp, group=group).reshape(shard.shape)
    return M.gather_from_sequence_parallel_region(back, False, group=group)


# (name, regions applied to the same activation on every rank, scale of the serial equivalent)
MAPPING_CASES = [
    ("copy_to -> reduce_from", lambda h, g: M.reduce_from_tensor_model_parallel_region(
        M.copy_to_tensor_model_parallel_region(h, group=g), group=g), "tp"),
    ("scatter_to -> gather_from", lambda h, g: M.gather_from_tensor_model_parallel_region(
        M.scatter_to_tensor_model_parallel_region(h, group=g), group=g), 1),
    ("sequence scatter -> gather", _sp_round_trip, 1),
    ("sequence reduce-scatter -> gather", lambda h, g: M.gather_from_sequence_parallel_region(
        M.reduce_scatter_to_sequence_parallel_region(h, group=g), group=g), "tp"),
    ("last-dim reduce-scatter -> all-gather", lambda h, g:
        M.all_gather_last_dim_from_tensor_parallel_region(
            M.reduce_scatter_last_dim_to_tensor_parallel_region(h, group=g), group=g), "tp"),
    ("all_to_all sp2hp -> hp2sp", _all_to_all_round_trip, 1),
]  # fmt: skip


def check_mappings(report, tp, rank, dtype):
    """Every region function on an autocast (half-precision) activation: dtype kept, values and
    gradients those of the serial equivalent (identity, or a sum of tp equal copies)."""
    group = ps.get_tensor_model_parallel_group()
    x, dy = randn(SEQ, BATCH, HIDDEN, seed=17), randn(SEQ, BATCH, HIDDEN, seed=18)
    w = full_weight(HIDDEN, HIDDEN, SEED).to(device.current_device())
    for name, regions, scale in MAPPING_CASES:
        scale = tp if scale == "tp" else scale
        x_in, w_in, x_ref, w_ref = leaf(x), leaf(w), leaf(x), leaf(w)
        with autocast(dtype):
            out = regions(F.linear(x_in, w_in), group)
            y_ref = F.linear(x_ref, w_ref) * scale
        report.true(f"{dtype} {name} keeps {dtype}", out.dtype == dtype)
        out.backward(dy.to(out.dtype))
        y_ref.backward(dy.to(y_ref.dtype))
        report.close(f"{dtype} {name} output", out, y_ref, TOL[dtype])
        report.close(f"{dtype} {name} input grad", x_in.grad, x_ref.grad, TOL[dtype])
        report.close(f"{dtype} {name} weight grad", w_in.grad, w_ref.grad, TOL[dtype])


CHECKS = {
    "column": check_column,
    "row": check_row,
    "linear_function": check_linear_function,
    "embedding": check_embedding,
    "cross_entropy": check_cross_entropy,
    "checkpoint": check_checkpoint,
    "params": check_params,
    "mappings": check_mappings,
}


def _all_checks():
    ps.initialize_model_parallel(tensor_model_parallel_size=torch.distributed.get_world_size())
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    report = Report(check_dtype=True)
    for topic, check in CHECKS.items():
        report.topic = topic
        for dtype in DTYPES:
            try:
                check(report, tp, rank, dtype)
            except Exception as exc:  # recorded, so no rank leaves the others in a collective
                report._record(f"{dtype} raised", f"{type(exc).__name__}: {exc}")
    return report.checked, report.failures


@functools.cache
def _results(world_size):
    return run_distributed(_all_checks, world_size, timeout=240)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("topic", TOPICS)
def test_autocast(topic, world_size):
    for rank, (checked, failures) in enumerate(_results(world_size)):
        assert checked.get(topic, 0) > 0, f"rank {rank}: no {topic} check ran"
        assert not failures.get(topic), f"rank {rank}: " + "\n".join(failures[topic])


def test_linear_function_bias_none_regression():
    """A bias of None under autocast (once a crash): autocast forward, backward outside it."""
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, False, False, False
        )
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == weight.grad.dtype == torch.float32
