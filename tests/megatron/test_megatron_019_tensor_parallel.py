"""megatron-core 0.17-0.19 names in tensor_parallel, on gloo ranks against unsharded torch.

Each rank builds the same full inputs from a fixed seed; the reference is torch on the full
weights (gathered from the layers' shards). Covered: ``vocab_parallel_cross_entropy(...,
tp_group)``, ``all_to_all(..., use_nccl_stream=True)``, delayed weight gradients
(``delay_wgrad_compute`` + ``backward_dw``, with and without gradient-accumulation fusion and
sequence parallelism), the inference layers in eval and training mode, the inference region
functions, ``param_is_not_tensor_parallel_duplicate(..., expert_tp_group)``, the gtp helpers
and the one refusal of ``gtp_remat_size > 1``.

Tolerances: fp32 throughout; sharded and full computations differ only in the order of sums
(per shard, then across ranks), so fp32 rounding is all that separates them: 1e-5.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint  # torch < 2.7 does not import this submodule by itself

from megatron_core import ModelParallelConfig
from megatron_core import parallel_state as ps
from megatron_core import tensor_parallel as tp_api
from megatron_core.errors import ConfigError, MegatronCoreError
from megatron_core.tensor_parallel import inference_layers as inf
from megatron_core.testing import run_distributed

S, B, H, FF, V = 8, 2, 8, 16, 16  # divisible by 1, 2, 4
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _init(weight):
    return torch.nn.init.normal_(weight, std=0.5)


def _config(tp, **kwargs):
    return ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, **kwargs)


def _full(shard, dim):
    """The unsharded tensor: this rank's shard all-gathered over the TP group along ``dim``."""
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(group.size())]
    dist.all_gather(parts, shard.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _mine(full, dim):
    """This rank's slice of ``full`` along ``dim``."""
    group = ps.get_tensor_model_parallel_group()
    return full.chunk(group.size(), dim=dim)[group.rank()]


def _inputs():
    gen = torch.Generator().manual_seed(11)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


# --- delayed weight gradient -----------------------------------------------------------------


def _delayed_step(tp, sp, fusion, delay):
    """One forward/backward of Column -> Row; returns the layers, the input and the reference
    (full weights, full input gradient and full weight gradients)."""
    torch.manual_seed(3)
    config = _config(tp, sequence_parallel=sp, delay_wgrad_compute=delay,
                     gradient_accumulation_fusion=fusion)  # fmt: skip
    col = tp_api.ColumnParallelLinear(H, FF, config=config, init_method=_init, bias=True)
    row = tp_api.RowParallelLinear(FF, H, config=config, init_method=_init, bias=True,
                                   input_is_parallel=True, skip_bias_add=False)  # fmt: skip
    for layer in (col, row):
        if fusion:
            layer.weight.main_grad = torch.zeros_like(layer.weight)
    x_full, grad_full = _inputs()
    x = (_mine(x_full, 0) if sp else x_full).clone().requires_grad_()
    out, _ = row(col(x)[0])
    (out * (_mine(grad_full, 0) if sp else grad_full)).sum().backward()
    w1, b1, w2 = _full(col.weight, 0), _full(col.bias, 0), _full(row.weight, 1)
    ref_x = x_full.clone().requires_grad_()
    ref_w1, ref_w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ref = F.linear(F.linear(ref_x, ref_w1, b1), ref_w2, row.bias.detach())
    torch.testing.assert_close(out, _mine(ref, 0) if sp else ref, **TOL)
    (ref * grad_full).sum().backward()
    return col, row, x, ref_x.grad, ref_w1.grad, ref_w2.grad


def _delayed_body(sp, fusion):
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tp)
    sp = sp and tp > 1
    col, row, x, ref_xg, ref_w1g, ref_w2g = _delayed_step(tp, sp, fusion, delay=True)
    torch.testing.assert_close(x.grad, _mine(ref_xg, 0) if sp else ref_xg, **TOL)
    grads = [layer.weight.main_grad if fusion else layer.weight.grad for layer in (col, row)]
    deferred = [g is None or not g.any() for g in grads]  # nothing yet (rule 1)
    col.backward_dw()
    row.backward_dw()
    col.backward_dw()  # nothing left: a second call adds nothing (rule 3)
    grads = [layer.weight.main_grad if fusion else layer.weight.grad for layer in (col, row)]
    torch.testing.assert_close(grads[0], _mine(ref_w1g, 0), **TOL)
    torch.testing.assert_close(grads[1], _mine(ref_w2g, 1), **TOL)
    # Without the option: the same gradients in backward, and backward_dw is a no-op.
    col2, row2, *_ = _delayed_step(tp, sp, fusion, delay=False)
    before = (col2.weight.main_grad if fusion else col2.weight.grad).clone()
    col2.backward_dw()
    after = col2.weight.main_grad if fusion else col2.weight.grad
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(after, grads[0], **TOL)
    return deferred + [_recompute_case(tp, sp, reentrant) for reentrant in (True, False)]


def _recompute_case(tp, sp, reentrant) -> bool:
    """Inside activation recompute (rule 5): the same gradient, nothing left queued."""
    config = _config(tp, sequence_parallel=sp, delay_wgrad_compute=True)
    col = tp_api.ColumnParallelLinear(H, FF, config=config, init_method=_init, bias=False)
    x_full, _ = _inputs()
    x = (_mine(x_full, 0) if sp else x_full).clone().requires_grad_()
    if reentrant:
        out = tp_api.checkpoint(lambda t: col(t)[0], False, x)
    else:
        out = torch.utils.checkpoint.checkpoint(lambda t: col(t)[0], x, use_reentrant=False)
    out.pow(2).sum().backward()
    col.backward_dw()
    ref_w = _full(col.weight, 0).requires_grad_()
    F.linear(x_full, ref_w).chunk(tp, dim=-1)[dist.get_rank()].pow(2).sum().backward()
    torch.testing.assert_close(col.weight.grad, _mine(ref_w.grad, 0), **TOL)
    return not col._wgrad_store.pending


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("sp,fusion", [(False, False), (True, True)])
def test_backward_dw_computes_the_delayed_weight_gradient(world_size, sp, fusion):
    """delay_wgrad_compute: backward leaves the weight gradients to backward_dw, which then
    gives torch's full-weight gradient shard (into main_grad with fusion)."""
    expect = [[True] * 4] * world_size
    assert run_distributed(_delayed_body, world_size, sp, fusion) == expect


# --- inference layers --------------------------------------------------------------------------


def _check_inference_pair(tp, sp, x_full):
    config = _config(tp, sequence_parallel=sp)
    col = inf.InferenceColumnParallelLinear(
        H, FF, config=config, init_method=_init, gather_output=False, bias=True,
        skip_bias_add=False, is_expert=False, name="fc1",
    )  # fmt: skip
    row = inf.InferenceRowParallelLinear(
        FF, H, config=config, init_method=_init, bias=True, input_is_parallel=True,
        skip_bias_add=False, is_expert=False, name="fc2",
    )  # fmt: skip
    ref = F.linear(F.linear(x_full, _full(col.weight, 0), _full(col.bias, 0)),
                   _full(row.weight, 1), row.bias)  # fmt: skip
    x = _mine(x_full, 0) if sp else x_full
    trained = row(col(x)[0])[0]
    col.eval(), row.eval()
    hidden, none = col(x)
    out, none2 = row(hidden, residual=x)
    assert none is None and none2 is None
    expect = _mine(ref, 0) if sp else ref
    torch.testing.assert_close(out, expect, **TOL)
    torch.testing.assert_close(trained, expect, **TOL)


def _check_layer_norm_column(tp, sp, x_full):
    config = _config(tp, sequence_parallel=sp)
    layer = inf.InferenceLayerNormColumnParallelLinear(
        H, FF, config=config, init_method=_init, gather_output=False, bias=False,
        skip_bias_add=False, is_expert=False,
    )  # fmt: skip
    with torch.no_grad():
        layer.layer_norm_weight.uniform_(0.5, 1.5)  # the same on every rank (seeded)
        layer.layer_norm_bias.uniform_(-0.5, 0.5)
    normed = F.layer_norm(x_full, (H,), layer.layer_norm_weight, layer.layer_norm_bias)
    ref = F.linear(normed, layer.weight)  # this rank's output columns
    layer.eval()
    out, _ = layer(_mine(x_full, 0) if sp else x_full)
    torch.testing.assert_close(out, ref, **TOL)


def _check_inference_linear(tp, sp, x_full):
    config = _config(tp, sequence_parallel=sp)
    kwargs = dict(config=config, init_method=_init, bias=True, skip_bias_add=False,
                  skip_weight_param_allocation=False)  # fmt: skip
    col = inf.InferenceLinear(H, FF, parallel_mode="column", **kwargs)
    row = inf.InferenceLinear(FF, H, parallel_mode="row", **kwargs)
    dup = inf.InferenceLinear(H, H, parallel_mode="duplicated", **kwargs)
    w1, b1, w2 = _full(col.weight, 0), _full(col.bias, 0), _full(row.weight, 1)
    ref = F.linear(F.linear(F.linear(x_full, w1, b1), w2, row.bias), dup.weight, dup.bias)
    x = _mine(x_full, 0) if sp else x_full
    out = dup(row(col(x)[0])[0])[0]
    torch.testing.assert_close(out, _mine(ref, 0) if sp else ref, **TOL)


def _inference_body():
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tp)
    torch.manual_seed(5)
    x_full, _ = _inputs()
    sp = tp > 1  # megatron-core's inference layers need sequence parallelism when tp > 1
    _check_inference_pair(tp, sp, x_full)
    _check_layer_norm_column(tp, sp, x_full)
    _check_inference_linear(tp, sp, x_full)
    _check_inference_linear(tp, False, x_full)  # InferenceLinear: also f / g regions
    group = ps.get_tensor_model_parallel_group()
    gathered = inf.inference_all_gather_from_tensor_model_parallel_region(
        _mine(x_full, -1), group, None
    )
    torch.testing.assert_close(gathered, x_full, rtol=0, atol=0)
    scattered = inf.inference_reduce_scatter_to_sequence_parallel_region(x_full, group, None)
    torch.testing.assert_close(scattered, _mine(x_full * tp, 0), **TOL)
    if tp > 1:
        with pytest.raises(MegatronCoreError, match="sequence_parallel"):
            inf.InferenceRowParallelLinear(
                FF, H, config=_config(tp), init_method=_init, bias=False,
                input_is_parallel=True, skip_bias_add=True, is_expert=False,
            )  # fmt: skip
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_inference_layers_match_torch(world_size):
    assert run_distributed(_inference_body, world_size) == [True] * world_size


# --- cross entropy, all_to_all, duplicates, gtp -----------------------------------------------


def _mappings_body():
    world = dist.get_world_size()
    ps.initialize_model_parallel(world)
    group = ps.get_tensor_model_parallel_group()
    rank = group.rank()
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(S, B, V, generator=gen)
    target = torch.randint(0, V, (S, B), generator=gen)
    shard = _mine(logits, -1).clone().requires_grad_()
    loss = tp_api.vocab_parallel_cross_entropy(shard, target, 0.0, group)  # tp_group positional
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction="none")
    torch.testing.assert_close(loss, ref.view(S, B), **TOL)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(shard.grad, _mine(ref_logits.grad, -1), **TOL)
    other = dist.new_group([0]) if world > 1 else None
    if world > 1:
        with pytest.raises(MegatronCoreError, match="tp_group and group"):
            tp_api.vocab_parallel_cross_entropy(shard, target, tp_group=group, group=other)
    # all_to_all: rank r's row block i goes to rank i, on either path, forward and backward.
    x = torch.arange(world * 2 * 3, dtype=torch.float32).view(world * 2, 3) + 100 * rank
    x.requires_grad_()
    a = tp_api.all_to_all(group, x, None, None, True)
    b = tp_api.all_to_all(group, x.detach(), use_nccl_stream=False)
    expect = torch.cat([torch.arange(world * 6.0).view(world * 2, 3)[2 * rank : 2 * rank + 2]
                        + 100 * src for src in range(world)])  # fmt: skip
    torch.testing.assert_close(a, expect, rtol=0, atol=0)
    torch.testing.assert_close(b, expect, rtol=0, atol=0)
    a.backward(a.detach())  # the reverse exchange brings every row home
    torch.testing.assert_close(x.grad, x.detach(), rtol=0, atol=0)
    # Duplicates: an expert parameter (allreduce False) is counted on expert-TP rank 0.
    replicated, expert = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    expert.allreduce = False
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    counted = (
        tp_api.param_is_not_tensor_parallel_duplicate(replicated, group, alone),
        tp_api.param_is_not_tensor_parallel_duplicate(expert, group, alone),
        tp_api.param_is_not_tensor_parallel_duplicate(expert, group),
        tp_api.param_is_not_gtp_duplicate(expert),
        tp_api.param_is_not_gtp_duplicate(replicated),
    )
    return counted == (rank == 0, True, rank == 0, True, True)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cross_entropy_all_to_all_and_duplicates(world_size):
    assert run_distributed(_mappings_body, world_size) == [True] * world_size


def test_gtp_helpers_and_refusal():
    source, destination = torch.nn.Parameter(torch.ones(1)), torch.ones(1)
    source.is_gtp_weight_remat, source.allreduce = True, False
    tp_api.copy_gtp_attributes(destination, source)
    assert destination.is_gtp_weight_remat is True and destination.allreduce is False
    assert tp_api.get_gtp_remat_rng_tracker_name() == "gtp-remat-rng"
    assert tp_api.get_gtp_remat_rng_tracker_name(is_expert=True) == "egtp-remat-rng"
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    out = tp_api.linear_with_grad_accumulation_and_async_allreduce(
        x, w, None, False, False, False, gtp_remat_size=1
    )
    torch.testing.assert_close(out, torch.full((2, 3), 4.0))
    with pytest.raises(ConfigError, match=r"gtp_remat_size \(2\) > 1"):
        tp_api.linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, False, False, False, gtp_remat_size=2
        )
    with pytest.raises(ConfigError, match="gtp_remat_size"):
        tp_api.linear_with_frozen_weight(x, w, None, False, False, False, None, gtp_remat_size=3)
