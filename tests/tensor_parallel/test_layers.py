"""ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding and ModelParallelConfig.

Every layer is compared with a serial torch module (nn.Linear / nn.Embedding / a LayerNorm MLP)
built from the same full weight, drawn from one seed on every rank. Outputs and all gradients
(input, weight, bias) must agree; a sharded gradient is compared with its slice of the full one.

One per-rank body runs every multi-rank check for a world size (TP = world size) and records each
comparison under a topic instead of raising, so a mismatch never leaves the other ranks blocked
in a collective. The result is cached per world size; each test below asserts one topic.

Tolerances:
- fp32: torch.testing's defaults (rtol 1.3e-6, atol 1e-5). The parallel layers compute the same
  products as the serial module; only the order of the sums differs (partial sums per rank,
  then a reduction), so the results agree to fp32 rounding.
- bf16: rtol = atol = 3e-2 against an fp32 reference built from the same bf16-rounded values.
  bf16 keeps 8 significant bits (eps 2^-8 = 3.9e-3); an O(1) output is rounded up to three times
  on the way (the local matmul, the partial sum, the bf16 all-reduce or reduce-scatter), and the
  backward adds the rounding of the input gradient; the reference rounds at none of those points.
- weights from initialization: exact (the same draws, only sliced).
"""

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_reference import Report, full_weight, init_method, leaf, shard

from megatron_core import device
from megatron_core import parallel_state as ps
from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel import layers
from megatron_core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron_core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_core.testing import run_distributed

WORLD_SIZES = (1, 2, 4)
SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 8, 16, 16  # all divisible by 4, the largest TP size
SEED = 4321
TOLERANCE = {torch.float32: {}, torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}  # see module doc
EXACT = {"rtol": 0, "atol": 0}


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def config(tp, sp=False, dtype=torch.float32, **kwargs):
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        params_dtype=dtype,
        **kwargs,
    )


def linear_ref(in_size, out_size, weight_seed, bias, dtype=torch.float32):
    """Serial nn.Linear (fp32) holding the full weight (rounded to ``dtype``) and ``bias``."""
    ref = torch.nn.Linear(in_size, out_size)
    with torch.no_grad():
        ref.weight.copy_(full_weight(out_size, in_size, weight_seed).to(dtype))
        ref.bias.copy_(bias)
    return ref


# --- per-rank checks, one topic each --------------------------------------------------------


def check_column(report, tp, rank, dtype):
    x = randn(SEQ, BATCH, HIDDEN, seed=1).to(dtype)
    dy = randn(SEQ, BATCH, FFN, seed=2).to(dtype)
    bias = randn(FFN, seed=3).to(dtype)
    variants = [  # (sequence_parallel, gather_output, async allreduce, skip_bias_add)
        (False, False, False, False),
        (False, True, False, False),
        (False, False, True, False),
        (False, False, False, True),
    ]
    if tp > 1:
        variants += [(True, False, False, False), (True, True, False, False)]
        variants += [(True, False, False, True)]
    for sp, gather, overlap, skip_bias in variants:
        name = f"{dtype} sp={sp} gather={gather} async={overlap} skip_bias={skip_bias}"
        cfg = config(tp, sp, dtype, async_tensor_model_parallel_allreduce=overlap)
        torch.manual_seed(SEED)
        layer = ColumnParallelLinear(
            HIDDEN, FFN, config=cfg, init_method=init_method, gather_output=gather,
            skip_bias_add=skip_bias,
        )  # fmt: skip
        with torch.no_grad():
            layer.bias.copy_(shard(bias, 0, tp, rank))
        x_in = leaf(shard(x, 0, tp, rank) if sp else x)
        out, out_bias = layer(x_in)
        if skip_bias:
            out = out + out_bias  # the caller adds the returned bias
        out.backward(dy if gather else shard(dy, -1, tp, rank))

        ref = linear_ref(HIDDEN, FFN, SEED, bias, dtype)
        x_ref = leaf(x.float())
        y_ref = ref(x_ref)
        y_ref.backward(dy.float())
        tol = TOLERANCE[dtype]
        report.close(f"{name} output", out, y_ref if gather else shard(y_ref, -1, tp, rank), tol)
        dx = shard(x_ref.grad, 0, tp, rank) if sp else x_ref.grad
        report.close(f"{name} input grad", x_in.grad, dx, tol)
        dw = shard(ref.weight.grad, 0, tp, rank)
        report.close(f"{name} weight grad", layer.weight.grad, dw, tol)
        report.close(f"{name} bias grad", layer.bias.grad, shard(ref.bias.grad, 0, tp, rank), tol)


def check_row(report, tp, rank, dtype):
    x = randn(SEQ, BATCH, FFN, seed=4).to(dtype)
    dy = randn(SEQ, BATCH, HIDDEN, seed=5).to(dtype)
    bias = randn(HIDDEN, seed=6).to(dtype)
    variants = [(False, True, False), (False, False, False), (False, True, True)]
    if tp > 1:  # (sequence_parallel, input_is_parallel, skip_bias_add)
        variants += [(True, True, False), (True, True, True)]
    for sp, parallel_input, skip_bias in variants:
        name = f"{dtype} sp={sp} input_is_parallel={parallel_input} skip_bias={skip_bias}"
        torch.manual_seed(SEED)
        layer = RowParallelLinear(
            FFN, HIDDEN, config=config(tp, sp, dtype), init_method=init_method, bias=True,
            input_is_parallel=parallel_input, skip_bias_add=skip_bias,
        )  # fmt: skip
        with torch.no_grad():
            layer.bias.copy_(bias)
        x_in = leaf(shard(x, -1, tp, rank) if parallel_input else x)
        out, out_bias = layer(x_in)
        if skip_bias:
            out = out + out_bias
        out.backward(shard(dy, 0, tp, rank) if sp else dy)
        report.true(f"{name} bias.sequence_parallel", layer.bias.sequence_parallel == sp)
        # Under SP the bias saw only this rank's rows: its gradient is partial until all-reduced.
        allreduce_sequence_parallel_grads(layer)

        ref = linear_ref(FFN, HIDDEN, SEED, bias, dtype)
        x_ref = leaf(x.float())
        y_ref = ref(x_ref)
        y_ref.backward(dy.float())
        tol = TOLERANCE[dtype]
        report.close(f"{name} output", out, shard(y_ref, 0, tp, rank) if sp else y_ref, tol)
        dx = shard(x_ref.grad, -1, tp, rank) if parallel_input else x_ref.grad
        report.close(f"{name} input grad", x_in.grad, dx, tol)
        dw = shard(ref.weight.grad, 1, tp, rank)
        report.close(f"{name} weight grad", layer.weight.grad, dw, tol)
        report.close(f"{name} bias grad", layer.bias.grad, ref.bias.grad, tol)


def check_embedding(report, tp, rank, dtype):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    dy = randn(BATCH, SEQ, HIDDEN, seed=8).to(dtype)
    for scatter, deterministic in [(False, False), (True, False), (False, True)]:
        name = f"{dtype} reduce_scatter={scatter} deterministic={deterministic}"
        torch.manual_seed(SEED)
        layer = VocabParallelEmbedding(
            VOCAB, HIDDEN, init_method=init_method, reduce_scatter_embeddings=scatter,
            config=config(tp, dtype=dtype, deterministic_mode=deterministic),
        )  # fmt: skip
        out = layer(ids)
        # Reduce-scatter turns [b, s, h] into this rank's rows of [s, b, h].
        out.backward(shard(dy.transpose(0, 1), 0, tp, rank) if scatter else dy)
        ref = torch.nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            ref.weight.copy_(full_weight(VOCAB, HIDDEN, SEED).to(dtype))
        y_ref = ref(ids)
        y_ref.backward(dy.float())
        expected = shard(y_ref.transpose(0, 1), 0, tp, rank) if scatter else y_ref
        tol = TOLERANCE[dtype]
        report.close(f"{name} output", out, expected, tol)
        dw = shard(ref.weight.grad, 0, tp, rank)
        report.close(f"{name} weight grad", layer.weight.grad, dw, tol)


def check_mlp(report, tp, rank):
    """LayerNorm -> Column -> gelu -> Row; under SP the LN grads too (megatron issue 1446)."""
    x, dy = randn(SEQ, BATCH, HIDDEN, seed=9), randn(SEQ, BATCH, HIDDEN, seed=10)
    ln_weight, ln_bias = 1 + 0.1 * randn(HIDDEN, seed=11), randn(HIDDEN, seed=12)
    fc1_bias, fc2_bias = randn(FFN, seed=13), randn(HIDDEN, seed=14)
    for sp in [False, True] if tp > 1 else [False]:
        cfg = config(tp, sp)
        ln = torch.nn.LayerNorm(HIDDEN)
        torch.manual_seed(SEED)
        fc1 = ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=init_method)
        torch.manual_seed(SEED + 1)
        fc2 = RowParallelLinear(
            FFN, HIDDEN, config=cfg, init_method=init_method, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip
        with torch.no_grad():
            ln.weight.copy_(ln_weight)
            ln.bias.copy_(ln_bias)
            fc1.bias.copy_(shard(fc1_bias, 0, tp, rank))
            fc2.bias.copy_(fc2_bias)
        for param in ln.parameters():
            param.sequence_parallel = sp  # as megatron-core marks its LayerNorm weights
        x_in = leaf(shard(x, 0, tp, rank) if sp else x)
        out, _ = fc2(F.gelu(fc1(ln(x_in))[0]))
        out.backward(shard(dy, 0, tp, rank) if sp else dy)
        allreduce_sequence_parallel_grads(torch.nn.ModuleList([ln, fc1, fc2]))

        ref_ln = torch.nn.LayerNorm(HIDDEN)
        with torch.no_grad():
            ref_ln.weight.copy_(ln_weight)
            ref_ln.bias.copy_(ln_bias)
        ref1 = linear_ref(HIDDEN, FFN, SEED, fc1_bias)
        ref2 = linear_ref(FFN, HIDDEN, SEED + 1, fc2_bias)
        x_ref = leaf(x)
        y_ref = ref2(F.gelu(ref1(ref_ln(x_ref))))
        y_ref.backward(dy)

        rows = functools.partial(shard, dim=0, tp=tp, rank=rank) if sp else (lambda t: t)
        name, tol = f"sp={sp}", TOLERANCE[torch.float32]
        report.close(f"{name} output", out, rows(y_ref), tol)
        report.close(f"{name} input grad", x_in.grad, rows(x_ref.grad), tol)
        report.close(f"{name} LN weight grad", ln.weight.grad, ref_ln.weight.grad, tol)
        report.close(f"{name} LN bias grad", ln.bias.grad, ref_ln.bias.grad, tol)
        dw1, db1 = shard(ref1.weight.grad, 0, tp, rank), shard(ref1.bias.grad, 0, tp, rank)
        report.close(f"{name} fc1 weight grad", fc1.weight.grad, dw1, tol)
        report.close(f"{name} fc1 bias grad", fc1.bias.grad, db1, tol)
        dw2 = shard(ref2.weight.grad, 1, tp, rank)
        report.close(f"{name} fc2 weight grad", fc2.weight.grad, dw2, tol)
        report.close(f"{name} fc2 bias grad", fc2.bias.grad, ref2.bias.grad, tol)


def gather_along(tensor, dim, group):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def check_cpu_init(report, world_size):
    """CPU init: the shards of every TP size concatenate to the same (TP=1) full weight."""
    gathered = {}
    for tp in [t for t in WORLD_SIZES if t <= world_size]:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        torch.manual_seed(SEED)
        col = ColumnParallelLinear(HIDDEN, FFN, config=config(tp), init_method=init_method)
        torch.manual_seed(SEED)
        row = RowParallelLinear(
            FFN, HIDDEN, config=config(tp), init_method=init_method, bias=False,
            input_is_parallel=True, skip_bias_add=False,
        )  # fmt: skip
        torch.manual_seed(SEED)
        emb = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=init_method, config=config(tp))
        gathered[tp] = (
            gather_along(col.weight.detach(), 0, group),
            gather_along(row.weight.detach(), 1, group),
            gather_along(emb.weight.detach(), 0, group),
        )
        # Stride 2 (e.g. a fused [gate; up] weight): rank r keeps chunks r and r + tp.
        torch.manual_seed(SEED)
        strided = ColumnParallelLinear(
            HIDDEN, FFN, config=config(tp, dtype=torch.bfloat16), init_method=init_method,
            stride=2, keep_master_weight_for_test=True,
        )  # fmt: skip
        master = full_weight(FFN, HIDDEN, SEED).to(torch.bfloat16)
        mine = torch.cat(master.split(FFN // tp // 2, dim=0)[rank::tp])
        report.close(f"tp={tp} stride 2 shard", strided.weight, mine, EXACT)
        report.close(f"tp={tp} kept master weight", strided.master_weight, master, EXACT)
        attributes = [
            (col.weight, (True, 0, 1)),
            (col.bias, (True, 0, 1)),
            (row.weight, (True, 1, 1)),
            (emb.weight, (True, 0, 1)),
            (strided.weight, (True, 0, 2)),
        ]
        for param, expected in attributes:
            got = (param.tensor_model_parallel, param.partition_dim, param.partition_stride)
            report.true(f"tp={tp} attributes {got} == {expected}", got == expected)
        ps.destroy_model_parallel()
    expected = (
        full_weight(FFN, HIDDEN, SEED),
        full_weight(HIDDEN, FFN, SEED),
        full_weight(VOCAB, HIDDEN, SEED),
    )
    for tp, weights in gathered.items():
        for what, got, want, tp1 in zip(
            ("column", "row", "embedding"), weights, expected, gathered[1]
        ):
            report.close(f"tp={tp} {what} == seed draw", got, want, EXACT)
            report.close(f"tp={tp} {what} == TP=1 weight", got, tp1, EXACT)


def check_device_init(report, tp, rank):
    """No CPU init: each rank draws its shard in the "model-parallel-rng" stream."""
    model_parallel_cuda_manual_seed(SEED)
    before = device.device_generator().get_state()  # the device's default stream
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp)
    layer = ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=init_method)
    report.close("default stream untouched", device.device_generator().get_state(), before, EXACT)
    model_parallel_cuda_manual_seed(SEED)
    with get_cuda_rng_tracker().fork():
        expected = init_method(torch.empty(FFN // tp, HIDDEN, device=device.current_device()))
    report.close("drawn in the fork", layer.weight, expected, EXACT)
    shards = gather_along(layer.weight.detach(), 0, ps.get_tensor_model_parallel_group())
    shards = shards.chunk(tp)
    report.true("shards differ across TP", all(not torch.equal(shards[0], s) for s in shards[1:]))
    model_parallel_cuda_manual_seed(SEED)
    with get_cuda_rng_tracker().fork():
        untouched = torch.rand(4)
    model_parallel_cuda_manual_seed(SEED)
    no_init = ModelParallelConfig(tensor_model_parallel_size=tp, perform_initialization=False)
    ColumnParallelLinear(HIDDEN, FFN, config=no_init, init_method=init_method)
    with get_cuda_rng_tracker().fork():
        report.close("perform_initialization=False draws nothing", torch.rand(4), untouched, EXACT)


def check_fusion(report, tp, rank):
    """gradient_accumulation_fusion: the fp32 main_grad accumulates two backward passes."""
    for dtype in (torch.float32, torch.bfloat16):
        cfg = config(tp, dtype=dtype, gradient_accumulation_fusion=True)
        col = ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=init_method)
        row = RowParallelLinear(
            FFN, HIDDEN, config=cfg, init_method=init_method, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip
        for layer in (col, row):  # created by megatron's DDP in real training
            layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
        expected_col = expected_row = 0
        for step in range(2):
            x = randn(SEQ, BATCH, HIDDEN, seed=20 + step).to(dtype)
            dy = randn(SEQ, BATCH, HIDDEN, seed=30 + step).to(dtype)
            h, _ = col(x.requires_grad_())
            out, _ = row(h)
            out.backward(dy)
            # fp32 weight gradients of this step, from the same (bf16-rounded) values.
            h32, x32, dy32 = h.detach().float(), x.detach().float(), dy.float()
            dh = dy32 @ row.weight.detach().float()
            expected_row = expected_row + dy32.reshape(-1, HIDDEN).t() @ h32.reshape(-1, FFN // tp)
            expected_col = expected_col + dh.reshape(-1, FFN // tp).t() @ x32.reshape(-1, HIDDEN)
        tol = TOLERANCE[dtype]
        report.true(f"{dtype} weight.grad stays None", col.weight.grad is row.weight.grad is None)
        report.true(f"{dtype} main_grad stays fp32", col.weight.main_grad.dtype == torch.float32)
        report.close(f"{dtype} column main_grad", col.weight.main_grad, expected_col, tol)
        report.close(f"{dtype} row main_grad", row.weight.main_grad, expected_row, tol)
    del col.weight.main_grad
    x_bf16 = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    report.raises("missing main_grad", lambda: col(x_bf16), "main_grad")
    # Deferred wgrad (megatron's embedding-wgrad deferral): dY is stashed, no weight gradient.
    weight, buffer = torch.ones(3, 4, requires_grad=True), []
    out = linear_with_grad_accumulation_and_async_allreduce(
        torch.ones(2, 4), weight, None, False, False, False, grad_output_buffer=buffer,
        wgrad_deferral_limit=0,
    )  # fmt: skip
    out.backward(torch.full((2, 3), 2.0))
    report.true("wgrad deferral", weight.grad is None and len(buffer) == 1)


def check_errors(report, tp, rank):
    """Bad values raise MegatronCoreError naming them, before any collective."""
    cfg = config(tp)

    def col(out=FFN, **kw):
        return ColumnParallelLinear(HIDDEN, out, init_method=init_method, **{"config": cfg, **kw})

    def row(inp=FFN, **kw):
        kw = {"config": cfg, "bias": True, "input_is_parallel": True, "skip_bias_add": False, **kw}
        return RowParallelLinear(inp, HIDDEN, init_method=init_method, **kw)

    # megatron-core sizes a layer from its group, never from config.tensor_model_parallel_size.
    sized = col(config=config(tp * 2))
    report.true("sized from the group", (sized.tp_size, sized.output_size_per_partition)
                == (tp, FFN // tp))  # fmt: skip
    report.raises("stride", lambda: col(stride=3), "stride (3)")
    report.raises("input last dim", lambda: col()(torch.ones(2, HIDDEN + 1)), f"must be {HIDDEN}")
    bad_weight = torch.ones(2, 2)
    report.raises("weight shape", lambda: col()(torch.ones(2, HIDDEN), weight=bad_weight), "(2, 2)")
    no_weight = col(skip_weight_param_allocation=True)
    report.raises("no weight", lambda: no_weight(torch.ones(2, HIDDEN)), "weight=")
    x_row = torch.ones(2, FFN // tp + 1)
    report.raises("row input last dim", lambda: row()(x_row), f"must be {FFN // tp}")
    # an input of another dtype than the layer's, autocast off (NOTE [ Check window ], rule 7)
    x64 = torch.ones(2, HIDDEN, dtype=torch.float64)
    wrong = "input dtype torch.float64 is not the layer's dtype torch.float32"
    report.raises("input dtype", lambda: col()(x64), wrong)
    if tp > 1:  # sequence parallelism all-gathers the input first
        report.raises("SP input dtype", lambda: col(config=config(tp, True))(x64), wrong)
    x64_row = torch.ones(2, FFN // tp, dtype=torch.float64)
    report.raises("row input dtype", lambda: row()(x64_row), wrong)
    ep_cfg = config(tp, expert_model_parallel_size=2)
    report.raises("expert needs skip_bias_add", lambda: row(config=ep_cfg, is_expert=True),
                  "skip_bias_add")  # fmt: skip
    if tp > 1:
        report.raises("column indivisible", lambda: col(out=tp + 1), f"output_size ({tp + 1})")
        report.raises("row indivisible", lambda: row(inp=tp + 1), f"input_size ({tp + 1})")
        report.raises(
            "embedding indivisible",
            lambda: VocabParallelEmbedding(tp + 1, 4, init_method=init_method, config=cfg),
            f"num_embeddings ({tp + 1})",
        )
        report.raises(
            "row SP without input_is_parallel",
            lambda: row(config=config(tp, True), input_is_parallel=False),
            "input_is_parallel",
        )
    else:  # a one-rank group turns sequence parallelism off with a warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer = col(config=config(2, True), tp_group=ps.get_tensor_model_parallel_group())
        warned = any("disabling sequence parallelism" in str(w.message) for w in caught)
        report.true("SP off on one rank, with a warning", warned and not layer.sequence_parallel)
    ones = torch.ones(1)  # after all the refusals every rank is still in step
    dist.all_reduce(ones)
    report.true("no rank left behind", ones.item() == dist.get_world_size())


def check_attributes(report, tp, rank):
    torch.manual_seed(SEED)
    row = RowParallelLinear(
        FFN, HIDDEN, config=config(tp), init_method=init_method, bias=True,
        input_is_parallel=True, skip_bias_add=False,
    )  # fmt: skip
    layers.set_defaults_if_not_set_tensor_model_parallel_attributes(row.bias)
    got = (row.bias.tensor_model_parallel, row.bias.partition_dim, row.bias.partition_stride)
    report.true("replicated bias gets the defaults", got == (False, -1, 1))
    report.true("a shard is never a duplicate",
                layers.param_is_not_tensor_parallel_duplicate(row.weight))  # fmt: skip
    report.true("a replicated bias counts on TP rank 0 only",
                layers.param_is_not_tensor_parallel_duplicate(row.bias) == (rank == 0))  # fmt: skip
    target = torch.empty(1)
    layers.copy_tensor_model_parallel_attributes(target, row.weight)
    got = (target.tensor_model_parallel, target.partition_dim, target.partition_stride)
    report.true("copy", got == (True, 1, 1))
    row.weight.is_qkv, row.weight.qkv_split_shapes = True, [256, 64, 64]  # 0.19's fused QKV
    layers.copy_tensor_model_parallel_attributes(target, row.weight)
    report.true("copy keeps 0.19's QKV marks",
                (target.is_qkv, target.qkv_split_shapes) == (True, [256, 64, 64]))  # fmt: skip
    report.raises(
        "set twice",
        lambda: layers.set_tensor_model_parallel_attributes(row.weight, True, 0, 1),
        "already set",
    )


def per_rank_body(world_size):
    report = Report(check_dtype=False)
    report.topic = "cpu_init"
    check_cpu_init(report, world_size)
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp, rank = world_size, ps.get_tensor_model_parallel_rank()
    for dtype in (torch.float32, torch.bfloat16):
        for report.topic, check in [
            ("column", check_column),
            ("row", check_row),
            ("embedding", check_embedding),
        ]:
            check(report, tp, rank, dtype)
    for report.topic, check in [
        ("mlp", check_mlp),
        ("device_init", check_device_init),
        ("fusion", check_fusion),
        ("errors", check_errors),
        ("attributes", check_attributes),
    ]:
        check(report, tp, rank)
    return report.checked, report.failures


@functools.cache
def _run(world_size):
    try:
        return run_distributed(per_rank_body, world_size, world_size, timeout=240), None
    except Exception as exc:  # cached too: the topics of a failed run fail without re-running
        return None, exc


def results(world_size):
    per_rank, error = _run(world_size)
    if error is not None:
        raise error
    return per_rank


TOPICS = ["column", "row", "embedding", "mlp", "cpu_init", "device_init", "fusion", "errors"]
TOPICS += ["attributes"]


@pytest.mark.parametrize("topic", TOPICS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layers_on_ranks(world_size, topic):
    """Topics: column / row / embedding / mlp (with LayerNorm, SP) vs serial torch; cpu_init and
    device_init; fusion (main_grad); errors; attributes. See the check_<topic> functions."""
    for rank, (checked, failures) in enumerate(results(world_size)):
        assert checked.get(topic, 0) > 0, f"rank {rank}: nothing checked for {topic}"
        assert topic not in failures, f"rank {rank}:\n" + "\n".join(failures[topic])


def test_every_recorded_topic_is_asserted():
    checked, _ = results(1)[0]
    assert sorted(checked) == sorted(TOPICS)


# --- without processes ----------------------------------------------------------------------


def test_config_defaults_are_megatron_cores():
    cfg = ModelParallelConfig()
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (1, 1)
    assert (cfg.context_parallel_size, cfg.expert_model_parallel_size) == (1, 1)
    assert cfg.perform_initialization and not cfg.use_cpu_initialization
    assert cfg.params_dtype == torch.float32 and not (cfg.fp16 or cfg.bf16)
    assert not (cfg.sequence_parallel or cfg.gradient_accumulation_fusion)
    assert cfg.async_tensor_model_parallel_allreduce  # deprecated and ignored, default True


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size (0)"),
        ({"expert_model_parallel_size": 1.5}, "expert_model_parallel_size (1.5)"),
        ({"fp16": True, "bf16": True}, "fp16 and bf16"),
        ({"params_dtype": "bf16"}, "params_dtype ('bf16')"),
        ({"pipeline_model_parallel_size": 2}, "pipeline_dtype"),
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size (2)"),
    ],
)
def test_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(MegatronCoreError, match="ModelParallelConfig") as info:
        ModelParallelConfig(**kwargs)
    assert needle in str(info.value)


def test_config_sequence_parallel_needs_tensor_parallelism():
    with pytest.raises(ValueError, match=r"needs tensor_model_parallel_size > 1 \(got 1\)"):
        ModelParallelConfig(sequence_parallel=True)
    assert ModelParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True
    ).sequence_parallel


def test_linear_function_rejects_bad_arguments_before_communicating():
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    linear = linear_with_grad_accumulation_and_async_allreduce
    with pytest.raises(MegatronCoreError, match=r"last dimension \(5"):
        linear(torch.ones(2, 5), w, None, False, False, False)
    with pytest.raises(MegatronCoreError, match="exclude each other"):
        linear(x, w, None, False, True, True)
    with pytest.raises(MegatronCoreError, match="contradicts"):
        linear(x, w, None, False, True, False, async_grad_allreduce=False)
    with pytest.raises(MegatronCoreError, match=r"main_grad of shape \(3, 4\)"):
        linear(x, w, None, True, False, False)


def test_linear_function_without_communication_is_nn_linear():
    """No collective asked for: works without parallel_state, equals F.linear and its grads."""
    x = randn(3, 2, 4, seed=40).requires_grad_()
    w, b = randn(5, 4, seed=41).requires_grad_(), randn(5, seed=42).requires_grad_()
    out = linear_with_grad_accumulation_and_async_allreduce(x, w, b, False, False, False)
    dy = randn(3, 2, 5, seed=43)
    out.backward(dy)
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    ref = F.linear(x, w, b)
    ref.backward(dy)
    torch.testing.assert_close(out, ref)  # fp32, same products: torch's default tolerance
    for got, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(got, t.grad)
