"""The stand-in's parameter names, state dicts and ``_extra_state`` (NOTE [ Extra state of
Transformer Engine modules ]), its initialization, and what it refuses.

Names and registration order are Transformer Engine 2.11's (read from its module sources);
``_extra_state`` without FP8 is ``torch.empty(0, dtype=torch.uint8)``, the value Transformer
Engine >= 2.0 writes, and FP8 metadata in Transformer Engine's format is kept and written back.
The refusals run on 2 ranks: each raises the same error, naming the feature, on every rank.
"""

from __future__ import annotations

import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from _te_checks import Report, assert_topic

from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed
from megatron_core.transformer_engine import common
from megatron_core.transformer_engine.pytorch import (
    DotProductAttention,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
    autocast,
    fp8_autocast,
    fp8_model_init,
    graph,
    initialize_ub,
    ops,
    quantized_model_init,
    router,
    utils,
)
from megatron_core.transformer_engine.pytorch.module import base

NAMES = [
    (lambda: Linear(4, 8, device="cpu"), ["weight", "bias"]),
    (lambda: Linear(4, 8, bias=False, device="cpu"), ["weight"]),
    (
        lambda: LayerNormLinear(4, 8, device="cpu"),
        ["layer_norm_weight", "layer_norm_bias", "weight", "bias"],
    ),
    (
        lambda: LayerNormLinear(4, 8, normalization="RMSNorm", bias=False, device="cpu"),
        ["layer_norm_weight", "weight"],
    ),
    (
        lambda: LayerNormMLP(4, 8, device="cpu"),
        [
            "layer_norm_weight",
            "layer_norm_bias",
            "fc1_weight",
            "fc1_bias",
            "fc2_weight",
            "fc2_bias",
        ],
    ),
    (
        lambda: GroupedLinear(2, 4, 8, device="cpu"),
        ["weight0", "bias0", "weight1", "bias1"],
    ),
    (lambda: GroupedLinear(2, 4, 8, bias=False, device="cpu"), ["weight0", "weight1"]),
    (lambda: LayerNorm(4, device="cpu"), ["weight", "bias"]),
    (lambda: RMSNorm(4, device="cpu"), ["weight"]),
    (lambda: DotProductAttention(2, 4), []),
]


@pytest.mark.parametrize("make, names", NAMES)
def test_state_dict_has_transformer_engines_names_and_an_empty_extra_state(make, names):
    module = make()
    state = module.state_dict()
    assert list(state) == [*names, "_extra_state"]
    extra = state["_extra_state"]
    assert extra.dtype == torch.uint8 and extra.numel() == 0
    module.load_state_dict(state)  # the empty extra state loads
    module.load_state_dict({**state, "_extra_state": None})  # so does an older checkpoint's None


def test_shapes_follow_the_parallel_mode_and_size():
    column = Linear(8, 16, tp_size=2, parallel_mode="column", device="cpu")
    row = Linear(8, 16, tp_size=2, parallel_mode="row", device="cpu")
    assert tuple(column.weight.shape) == (8, 8) and tuple(column.bias.shape) == (8,)
    assert tuple(row.weight.shape) == (16, 4) and tuple(row.bias.shape) == (16,)
    mlp = LayerNormMLP(8, 16, tp_size=2, activation="swiglu", device="cpu")
    assert tuple(mlp.fc1_weight.shape) == (16, 8) and tuple(mlp.fc2_weight.shape) == (8, 8)
    with pytest.raises(MegatronCoreError, match="set_tensor_parallel_group"):
        column(torch.zeros(2, 8))  # a size without a group: the group comes later
    with pytest.raises(
        MegatronCoreError,
        match=r"out_features \(6\) is not divisible by the tensor-parallel size \(4\)",
    ):
        Linear(8, 6, tp_size=4, parallel_mode="column", device="cpu")


def _fp8_state(recipe) -> dict:
    """What Transformer Engine >= 2.0 pickles into a delayed-scaling module's extra state."""
    return {
        "recipe": recipe,
        "scale_fwd": torch.ones(3),
        "amax_history_fwd": torch.zeros(16, 3),
        "scale_bwd": torch.ones(2),
        "amax_history_bwd": torch.zeros(16, 2),
        "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True},
    }


def test_fp8_metadata_is_kept_and_written_back(monkeypatch):
    monkeypatch.setattr(base, "_WARNED_FP8_STATE", False)  # it warns once per process
    recipe = common.recipe.DelayedScaling(amax_history_len=16)
    data = torch.frombuffer(bytearray(pickle.dumps(_fp8_state(recipe))), dtype=torch.uint8)
    layer = Linear(4, 8, device="cpu")
    with pytest.warns(UserWarning, match="FP8 metadata"):
        layer.load_state_dict({**layer.state_dict(), "_extra_state": data})
    assert layer.fp8_meta["recipe"] == recipe and layer.fp8_meta["fp8_checkpoint"]
    assert torch.equal(layer.state_dict()["_extra_state"], data)
    older = io.BytesIO()  # Transformer Engine 1.x's format
    torch.save(_fp8_state(recipe), older)
    norm = LayerNorm(4, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        norm.load_state_dict({**norm.state_dict(), "_extra_state": older})
    assert norm.state_dict()["_extra_state"] is older


def test_a_checkpoint_without_core_attention_extra_state_loads():
    parent = torch.nn.Module()
    parent.core_attention = DotProductAttention(2, 4)
    parent.linear = Linear(4, 4, device="cpu")
    state = parent.state_dict()
    del state["core_attention._extra_state"]
    assert parent.load_state_dict(state).missing_keys == []


def test_initialization_draws_inside_the_tracker_stream():
    class Tracker:
        forks: list = []

        def fork(self, name="model-parallel-rng"):
            self.forks.append(name)
            return torch.random.fork_rng()

    torch.manual_seed(3)
    layer = Linear(4, 8, get_rng_state_tracker=Tracker, rng_tracker_name="expert", device="cpu")
    assert Tracker.forks == ["expert"]
    torch.manual_seed(3)
    assert torch.equal(layer.weight, torch.nn.init.normal_(torch.empty(8, 4), std=0.023))
    assert torch.equal(layer.bias, torch.zeros(8))
    deferred = Linear(4, 8, device="meta")
    assert deferred.weight.device.type == "meta"
    deferred.reset_parameters()
    assert deferred.weight.device.type == "cpu" and deferred.weight.tensor_model_parallel


def _refusals() -> list[tuple]:
    """(name, call, words the message names)."""
    mx, fp4 = common.recipe.MXFP8BlockScaling(), common.recipe.NVFP4BlockScaling()

    def enter(context):
        def call():
            with context:
                pass

        return call

    x = torch.zeros(2, 4)
    return [
        ("fp8_autocast", enter(fp8_autocast()), "fp8_autocast", "FP8", "DelayedScaling"),
        ("autocast MXFP8", enter(autocast(recipe=mx)), "autocast", "MXFP8"),
        ("calibrating", enter(fp8_autocast(enabled=False, calibrating=True)), "calibrating"),
        ("fp8_model_init", enter(fp8_model_init()), "fp8_model_init"),
        ("quantized_model_init FP4", enter(quantized_model_init(recipe=fp4)), "FP4"),
        ("ub_overlap_ag", lambda: Linear(4, 4, ub_overlap_ag=True), "ub_overlap_ag", "userbuffers"),
        (
            "ub_bulk_wgrad",
            lambda: LayerNormLinear(4, 4, ub_bulk_wgrad=True, ub_name="qkv"),
            "ub_bulk_wgrad",
        ),
        ("initialize_ub", initialize_ub, "initialize_ub", "userbuffers"),
        ("ops.Sequential", lambda: ops.Sequential(), "ops.Sequential", "operation fuser"),
        ("ops.BasicLinear", lambda: ops.BasicLinear(4, 4), "ops.BasicLinear"),
        ("make_graphed_callables", lambda: graph.make_graphed_callables(x), "CUDA graph"),
        ("set_capture_start", graph.set_capture_start, "CUDA graph"),
        ("make_weak_ref", lambda: utils.make_weak_ref(x), "make_weak_ref"),
        ("fused router", lambda: router.fused_topk_with_score_function(x, 2), "moe_router_fusion"),
        ("fused aux loss", lambda: router.fused_moe_aux_loss(x), "moe_router_fusion"),
        ("delay_wgrad_compute", lambda: Linear(4, 4, delay_wgrad_compute=True), "backward_dw"),
        ("symmetric all-reduce", lambda: Linear(4, 4, symmetric_ar_type="two_shot"), "symmetric"),
        ("parameters_split", lambda: Linear(4, 4, parameters_split=("a", "b")), "parameters_split"),
        (
            "single grouped weight",
            lambda: GroupedLinear(2, 4, 4, single_grouped_weight=True),
            "single_grouped_weight",
        ),
        ("fp8_output", lambda: Linear(4, 4, device="cpu")(x, fp8_output=True), "fp8_output"),
    ]


def refusal_report() -> dict:
    report = Report()
    report.topic = "refusals"
    for name, call, *needles in _refusals():
        report.raises(name, call, "not provided", *needles)
    report.topic = "disabled contexts"
    layer = Linear(4, 4, device="cpu")
    x = torch.ones(2, 4)
    want = layer(x)
    with fp8_autocast(enabled=False), autocast(enabled=False), fp8_model_init(enabled=False):
        with quantized_model_init(enabled=False):
            report.close("the block runs unchanged", layer(x), want, rtol=0, atol=0)
    dist.barrier()  # every rank got here: no rank is left in a collective
    return report.result()


@pytest.mark.parametrize("topic", ["refusals", "disabled contexts"])
def test_refusals_raise_by_name_on_every_rank(topic):
    assert_topic(run_distributed(refusal_report, 2, timeout=120), topic)


def test_get_dummy_wgrad_is_cached_and_zeroable():
    first = base.get_dummy_wgrad([2, 3], torch.float32)
    again = base.get_dummy_wgrad([2, 3], torch.float32, zero=True)
    assert first.data_ptr() == again.data_ptr() and torch.equal(again, torch.zeros(2, 3))
