"""megatron-core 0.16 semantics of the tensor-parallel layers and helpers.

Each multi-rank check runs at world sizes 1, 2 and 4 on gloo against an unsharded torch reference
built from the same seed: layers sized from their process group (not from the config), an explicit
``tp_group=`` without parallel_state, the frozen-weight path, ``disable_grad_reduce``, the
embedding-wgrad deferral buffers, the ``_extra_state`` state-dict entry, megatron-core's
VocabParallelCrossEntropy building blocks, and the positional ``tp_group`` of the helpers.

Tolerances: fp32 everywhere. A sharded matmul sums the same products as the full one in another
order (per-shard partial sums, then the all-reduce), so results differ from the reference by fp32
rounding only: torch's default fp32 tolerance (rtol 1.3e-6, atol 1e-5) covers it.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import ModelParallelConfig
from megatron_core import parallel_state as ps
from megatron_core import tensor_parallel as tp_api
from megatron_core.errors import ConfigError, MegatronCoreError
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_core.tensor_parallel.linear.base import set_expert_grad_rule
from megatron_core.testing import run_distributed

WORLD_SIZES = [1, 2, 4]
SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 8, 16, 16  # divisible by 8, the largest group


def _init(tensor):
    return torch.nn.init.normal_(tensor, std=0.5)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _full_weight(out_size, in_size, seed):
    """The master weight CPU initialization draws after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return _init(torch.empty(out_size, in_size))


def _config(**kwargs):
    """megatron-core models often leave tensor_model_parallel_size at its default of 1."""
    return ModelParallelConfig(use_cpu_initialization=True, **kwargs)


def _column(seed, group=None, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("config", _config())
    return ColumnParallelLinear(HIDDEN, FFN, init_method=_init, tp_group=group, **kwargs)


def _row(seed, group=None, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("config", _config())
    return RowParallelLinear(
        FFN, HIDDEN, init_method=_init, bias=True, input_is_parallel=True, skip_bias_add=False,
        tp_group=group, **kwargs,
    )  # fmt: skip


def _reference_mlp(x, dy):
    """Serial Linear(HIDDEN->FFN) -> gelu -> Linear(FFN->HIDDEN) with the same full weights."""
    w1, w2 = _full_weight(FFN, HIDDEN, 1).requires_grad_(), _full_weight(HIDDEN, FFN, 2)
    w2.requires_grad_()
    x = x.clone().requires_grad_()
    y = F.linear(F.gelu(F.linear(x, w1)), w2)
    y.backward(dy)
    return y.detach(), x.grad, w1.grad, w2.grad


def _mlp_matches_reference(group, rank, size):
    """Column -> gelu -> Row over ``group`` equals the serial MLP, forward and backward."""
    col, row = _column(1, group), _row(2, group)
    assert (col.tp_size, row.tp_size) == (size, size)
    assert col.output_size_per_partition == FFN // size
    x, dy = _randn(SEQ, BATCH, HIDDEN, seed=3), _randn(SEQ, BATCH, HIDDEN, seed=4)
    y_ref, gx_ref, gw1_ref, gw2_ref = _reference_mlp(x, dy)
    x = x.clone().requires_grad_()
    hidden, _ = col(x)
    y, _ = row(F.gelu(hidden))
    y.backward(dy)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, gx_ref)
    torch.testing.assert_close(col.weight.grad, gw1_ref.chunk(size, dim=0)[rank])
    torch.testing.assert_close(row.weight.grad, gw2_ref.chunk(size, dim=1)[rank])


def _sized_from_group():
    world, rank = dist.get_world_size(), dist.get_rank()
    # 1. parallel_state's group; the config keeps tensor_model_parallel_size=1 (its default).
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    _mlp_matches_reference(None, rank, world)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=_init, config=_config())
    assert emb.num_embeddings_per_partition == VOCAB // world
    ps.destroy_model_parallel()
    # 2. an explicit tp_group with parallel_state not initialized at all.
    _mlp_matches_reference(dist.group.WORLD, rank, world)
    return True


def _expert_layers_use_the_expert_tensor_parallel_group():
    """is_expert=True without tp_group: megatron-core's default is the expert-TP group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=world,
        expert_model_parallel_size=world,
        expert_tensor_parallel_size=1,
    )
    dense = _column(1)
    expert = _column(1, is_expert=True)
    assert (dense.tp_size, expert.tp_size) == (world, 1)
    assert expert.tp_group is ps.get_expert_tensor_parallel_group()
    torch.testing.assert_close(expert.weight, _full_weight(FFN, HIDDEN, 1))  # the whole matrix
    torch.testing.assert_close(dense.weight, _full_weight(FFN, HIDDEN, 1).chunk(world)[rank])
    # allreduce marks (reduced over the expert data-parallel group when False) follow the
    # layer's config, as megatron-core's do: under expert parallelism in both releases' rules;
    # with EP 1 and ETP != TP only under 0.19's
    assert dense.weight.allreduce and dense.bias.allreduce
    assert expert.weight.allreduce and expert.bias.allreduce  # its config: EP 1, ETP = TP = 1
    with_ep = _column(1, is_expert=True, config=_config(expert_model_parallel_size=2))
    assert (with_ep.weight.allreduce, with_ep.bias.allreduce) == (False, False)
    no_ep = dict(tensor_model_parallel_size=world, expert_tensor_parallel_size=1)
    marks = {}
    try:
        for release in ("0.16", "0.19"):
            set_expert_grad_rule(release)
            column = _column(1, is_expert=True, config=_config(**no_ep))
            row = _row(1, is_expert=True, config=_config(**no_ep))
            marks[release] = [column.weight.allreduce, column.bias.allreduce, row.weight.allreduce]
    finally:
        set_expert_grad_rule("0.19")
    assert marks == {"0.16": [True] * 3, "0.19": [world == 1] * 3}
    return True


def _frozen_and_disable_grad_reduce():
    world = dist.get_world_size()
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    x, dy = _randn(SEQ, BATCH, HIDDEN, seed=3), _randn(SEQ, BATCH, HIDDEN, seed=4)
    y_ref, gx_ref, _, gw2_ref = _reference_mlp(x, dy)
    for sequence_parallel in (False, True) if world > 1 else (False,):
        cfg = _config(tensor_model_parallel_size=world, sequence_parallel=sequence_parallel)
        col, row = _column(1, config=cfg), _row(2, config=cfg)
        col.weight.requires_grad_(False)  # frozen: LinearWithFrozenWeight
        col.bias.requires_grad_(False)
        seq = (lambda t: t.chunk(world, dim=0)[rank]) if sequence_parallel else (lambda t: t)
        x_in = seq(x).clone().requires_grad_()
        hidden, _ = col(x_in)
        y, _ = row(F.gelu(hidden))
        y.backward(seq(dy))
        torch.testing.assert_close(y, seq(y_ref))
        torch.testing.assert_close(x_in.grad, seq(gx_ref))
        assert col.weight.grad is None and col.bias.grad is None
        torch.testing.assert_close(row.weight.grad, gw2_ref.chunk(world, dim=1)[rank])
    # disable_grad_reduce: each rank's input gradient is its partial sum; their sum is dX.
    col, row = _column(1, disable_grad_reduce=True), _row(2)
    x_in = x.clone().requires_grad_()
    hidden, _ = col(x_in)
    row(F.gelu(hidden))[0].backward(dy)
    total = x_in.grad.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, gx_ref)
    if world > 1:
        assert not torch.allclose(x_in.grad, gx_ref)  # really not reduced
    return True


def _deferred_embedding_wgrad():
    """defer_embedding_wgrad_compute: the output layer stashes X and dY; dY^T X is its wgrad."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = _config(
        tensor_model_parallel_size=world,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=True,
        defer_embedding_wgrad_compute=True,
    )
    activations, grads = [], []
    col = _column(
        1, config=cfg, bias=False, embedding_activation_buffer=activations,
        grad_output_buffer=grads,
    )  # fmt: skip
    col.weight.main_grad = torch.zeros_like(col.weight)
    x, dy = _randn(SEQ, BATCH, HIDDEN, seed=3), _randn(SEQ, BATCH, FFN, seed=5)
    w = _full_weight(FFN, HIDDEN, 1).requires_grad_()
    x_ref = x.clone().requires_grad_()
    F.linear(x_ref, w).backward(dy)
    x_in = x.clone().requires_grad_()
    y, _ = col(x_in)
    y.backward(dy.chunk(world, dim=-1)[rank])
    assert len(activations) == len(grads) == 1
    assert not col.weight.main_grad.any() and col.weight.grad is None  # deferred: nothing yet
    wgrad = grads[0].reshape(-1, FFN // world).t() @ activations[0].reshape(-1, HIDDEN)
    torch.testing.assert_close(wgrad, w.grad.chunk(world, dim=0)[rank])
    torch.testing.assert_close(x_in.grad, x_ref.grad)
    with pytest.raises(MegatronCoreError, match="embedding_activation_buffer"):
        _column(1, config=cfg)
    return True


def _vocab_parallel_cross_entropy_blocks():
    """megatron-core's VocabParallelCrossEntropy steps + all-reduces give torch's loss and grad."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    blocks = tp_api.VocabParallelCrossEntropy
    logits = _randn(SEQ, BATCH, VOCAB, seed=6) * 3
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(7))
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.view(-1, VOCAB), target.view(-1), reduction="none")
    dy = _randn(SEQ, BATCH, seed=8)
    ref.backward(dy.view(-1))
    part = VOCAB // world
    local, logits_max = blocks.calculate_logits_max(logits.chunk(world, dim=-1)[rank].clone())
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
    mask, target_1d, predicted, sum_exp, exp_logits = blocks.calculate_predicted_logits(
        local, target, logits_max, rank * part, (rank + 1) * part
    )
    dist.all_reduce(predicted)
    dist.all_reduce(sum_exp)
    softmax, loss = blocks.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    torch.testing.assert_close(loss.view(-1), ref.detach())
    grad_2d, rows, update, grad_input = blocks.prepare_gradient_calculation_operands(softmax, mask)
    grad = blocks.calculate_gradients(grad_2d, rows, target_1d, update, grad_input, dy)
    torch.testing.assert_close(grad, full.grad.chunk(world, dim=-1)[rank])
    return True


def _helpers_take_tp_group_positionally():
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD  # parallel_state is not initialized: only the argument can work
    data = {"x": torch.arange(6).view(2, 3) + 100} if rank == 0 else None
    out = tp_api.broadcast_data(["x"], data, torch.int64, group)
    torch.testing.assert_close(out["x"].cpu(), torch.arange(6).view(2, 3) + 100)
    full = torch.arange(4.0 * world)
    chunk = tp_api.split_tensor_into_1d_equal_chunks(full, False, group)
    torch.testing.assert_close(chunk, full.chunk(world)[rank])
    torch.testing.assert_close(tp_api.gather_split_1d_tensor(chunk, group), full)
    replicated = torch.nn.Parameter(torch.ones(2))
    assert tp_api.param_is_not_tensor_parallel_duplicate(replicated, group) == (rank == 0)
    return True


BODIES = [
    _sized_from_group,
    _expert_layers_use_the_expert_tensor_parallel_group,
    _frozen_and_disable_grad_reduce,
    _deferred_embedding_wgrad,
    _vocab_parallel_cross_entropy_blocks,
    _helpers_take_tp_group_positionally,
]


@pytest.mark.parametrize("body", BODIES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_on_ranks(world_size, body):
    assert run_distributed(body, world_size, timeout=120) == [True] * world_size


def _every_body():
    for body in BODIES:
        assert body() is True, body.__name__
        ps.destroy_model_parallel()
    return True


def test_on_eight_ranks():
    """megatron-core's unit tests run at 8 ranks: every body above at TP 8, in one call (8
    processes on a small machine, so one pool start for all of them)."""
    assert run_distributed(_every_body, 8, timeout=300) == [True] * 8


def _extra_state_round_trip():
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    col, row = _column(1), _row(2)
    for layer in (col, row):
        state = layer.state_dict()
        assert list(state) == ["weight", "bias", "_extra_state"] and state["_extra_state"] is None
        # A megatron-core 0.16 state dict: weights plus _extra_state (TE writes a BytesIO).
        saved = {**state, "_extra_state": io.BytesIO()}
        assert not layer.load_state_dict(saved, strict=True).missing_keys
        # A plain torch state dict without _extra_state also loads strictly.
        plain = {k: v for k, v in state.items() if k != "_extra_state"}
        layer.load_state_dict(plain, strict=True)
    model = torch.nn.Sequential(col, row)
    assert "0._extra_state" in model.state_dict() and "1._extra_state" in model.state_dict()
    return True


def test_extra_state_in_state_dict():
    assert run_distributed(_extra_state_round_trip, 2, timeout=120) == [True, True]


# --- without processes ----------------------------------------------------------------------


# The inference layers compute (no Transformer Engine needed since megatron-core 0.19's names
# were added): tests/megatron/test_megatron_019_tensor_parallel.py.


def test_config_derived_defaults_are_megatron_cores():
    cfg = ModelParallelConfig(tensor_model_parallel_size=4, params_dtype=torch.bfloat16)
    assert cfg.expert_tensor_parallel_size == 4
    assert cfg.autocast_dtype == torch.bfloat16
    assert cfg.microbatch_group_size_per_vp_stage == 1
    assert ModelParallelConfig(expert_tensor_parallel_size=2).expert_tensor_parallel_size == 2


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"pipeline_model_parallel_size": 2}, "pipeline_dtype"),
        ({"defer_embedding_wgrad_compute": True}, "pipeline_model_parallel_size > 1"),
        (
            {
                "defer_embedding_wgrad_compute": True,
                "pipeline_model_parallel_size": 2,
                "pipeline_dtype": torch.float32,
            },
            "gradient_accumulation_fusion",
        ),  # fmt: skip
        ({"overlap_p2p_comm_warmup_flush": True}, "overlap_p2p_comm=True (got False)"),
        ({"cross_entropy_fusion_impl": "fast"}, "cross_entropy_fusion_impl ('fast')"),
        ({"tp_comm_bootstrap_backend": "tcp"}, "tp_comm_bootstrap_backend ('tcp')"),
        ({"expert_tensor_parallel_size": 0}, "expert_tensor_parallel_size (0)"),
        ({"autocast_dtype": "bf16"}, "autocast_dtype ('bf16')"),
    ],
)
def test_config_errors_are_value_errors_naming_the_values(kwargs, needle):
    """megatron-core raises ValueError from __post_init__; ConfigError is one (and ours)."""
    for catch in (ValueError, MegatronCoreError, AssertionError):
        with pytest.raises(catch) as info:
            ModelParallelConfig(**kwargs)
        assert isinstance(info.value, ConfigError) and needle in str(info.value)


def test_transformer_config_at_megatron_core_path():
    from megatron_core.transformer import TransformerConfig
    from megatron_core.transformer.transformer_config import TransformerConfig as at_path

    assert at_path is TransformerConfig and issubclass(at_path, ModelParallelConfig)
    assert (
        at_path(num_layers=1, hidden_size=8, num_attention_heads=2).distribute_saved_activations
        is False
    )


def test_graph_safe_rng_helpers_on_cpu():
    state = torch.get_rng_state()
    assert tp_api.convert_cuda_rng_state(state) is state
    gen = torch.Generator()
    torch.testing.assert_close(tp_api.convert_cuda_rng_state(gen), gen.get_state())
    assert tp_api.convert_cuda_rng_state(gen, to_graphable=True) is gen
    with pytest.raises(MegatronCoreError, match="accelerator"):
        tp_api.convert_cuda_rng_state(state, to_graphable=True)  # the CPU has no graph-safe state
    with pytest.raises(MegatronCoreError, match="list"):
        tp_api.convert_cuda_rng_state([1, 2])
    assert not tp_api.is_graph_safe_cuda_rng_tracker(tp_api.CudaRNGStatesTracker())

    class Cudagraphable:
        use_cudagraphable_rng = True

    assert tp_api.is_graph_safe_cuda_rng_tracker(Cudagraphable())
