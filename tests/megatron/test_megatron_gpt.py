"""megatron-core's own GPTModel (local layer spec) trained on this core through the switch.

Each test trains megatron-core 0.16.1's unmodified GPTModel a few Adam steps on gloo ranks, with
``megatron.core.parallel_state`` / ``tensor_parallel`` / ``pipeline_parallel`` /
``finalize_model_grads`` served by this package (megatron_core.megatron.install()), and compares
it with the same model at tp = pp = ep = 1 from the same initial weights. The bodies live in
tests/megatron/_megatron_gpt.py (imported by the ranks); nothing in them patches torch or
megatron-core (the switch's CPU mode answers megatron-core's CUDA calls).
"""

import dataclasses

import pytest
import torch

from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed
from megatron_core.testing.worker import harness_device_type

if megatron_core_version() is None:  # checked without importing megatron in the test process
    pytest.skip("megatron-core is not installed (the [megatron] extra)", allow_module_level=True)

from _megatron_gpt import Run, initial_state, replicas_after_host_draws, train  # noqa: E402

TIMEOUT = 240
DENSE = Run(microbatches=2)
MOE = Run(moe=True, microbatches=2)


@pytest.fixture(scope="module")
def dense_start():
    return run_distributed(initial_state, 1, DENSE, timeout=TIMEOUT)[0]


@pytest.fixture(scope="module")
def dense_reference(dense_start):
    return run_distributed(train, 1, DENSE, dense_start, timeout=TIMEOUT)[0]


def _assert_runs_equal(expected: dict, per_rank: list[dict], exact: bool = False) -> None:
    """Losses (last rank) and every unsharded gradient and final parameter of ``per_rank``
    (merged over pipeline stages and expert ranks) equal ``expected``. The tolerance 1e-5 allows
    for the different summation order of sharded matmuls and all-reduces in fp32."""

    def check(actual, wanted, what):
        if exact:
            assert torch.equal(actual, wanted), what
        else:
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5, msg=what)

    check(torch.stack(per_rank[-1]["losses"]), torch.stack(expected["losses"]), "losses")
    for step, grads in enumerate(expected["grads"]):
        merged = {name: g for rank in per_rank for name, g in rank["grads"][step].items()}
        assert merged.keys() == grads.keys()
        for name, grad in grads.items():
            check(merged[name], grad, f"step {step} grad of {name}")
    merged = {name: p for rank in per_rank for name, p in rank["params"].items()}
    for name, param in expected["params"].items():
        check(merged[name], param, f"final {name}")


def test_tensor_parallel_2_matches_1(distributed, dense_start, dense_reference):
    per_rank = distributed(train, 2, dataclasses.replace(DENSE, tp=2), dense_start, timeout=TIMEOUT)
    _assert_runs_equal(dense_reference, per_rank)


def test_tensor_parallel_2_with_sequence_parallel_matches_1(
    distributed, dense_start, dense_reference
):
    # megatron-core's local spec builds its norms with WrappedTorchNorm, which asserts "sequence
    # parallel not supported by torch LayerNorm" (SP needs apex or Transformer Engine there); the
    # run swaps in a LayerNorm whose parameters are marked sequence_parallel
    # (_megatron_gpt.SequenceParallelLayerNorm), as a CPU user would.
    run = dataclasses.replace(DENSE, tp=2, sp=True)
    _assert_runs_equal(dense_reference, distributed(train, 2, run, dense_start, timeout=TIMEOUT))


def test_pipeline_parallel_2_one_f_one_b_matches_1(distributed, dense_start, dense_reference):
    run = dataclasses.replace(DENSE, pp=2)
    _assert_runs_equal(dense_reference, distributed(train, 2, run, dense_start, timeout=TIMEOUT))


def test_pipeline_2_x_context_parallel_2_matches_1(distributed, dense_start, dense_reference):
    """CP through the switch's DotProductAttention (NOTE [ Without Transformer Engine ]) with
    1F1B: the schedules exchange [s/cp, b, h] activations between the stages."""
    run = dataclasses.replace(DENSE, pp=2, cp=2)
    _assert_runs_equal(dense_reference, distributed(train, 4, run, dense_start, timeout=TIMEOUT))


def test_recompute_is_bitwise_equal_with_dropout(distributed, dense_start):
    """Full recompute (distribute_saved_activations at tp = 2) and selective recompute (core_attn,
    layernorm, mlp) replay the dropout masks through this package's RNG tracker: bitwise the run
    without recompute, every gradient (the fc2 bias the MLP's checkpoint returns as is too)."""
    base = dataclasses.replace(DENSE, tp=2, dropout=0.1)
    plain = distributed(train, 2, base, dense_start, timeout=TIMEOUT)
    assert plain[0]["checkpoints"] == 0
    for recompute in ("full", "selective"):
        run = dataclasses.replace(base, recompute=recompute)
        per_rank = distributed(train, 2, run, dense_start, timeout=TIMEOUT)
        # per layer and microbatch (in the last step): full one, selective two (attention, MLP)
        per_layer = 1 if recompute == "full" else 2
        assert per_rank[0]["checkpoints"] == 2 * per_layer * DENSE.microbatches, recompute
        _assert_runs_equal(plain[0], per_rank, exact=True)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("expert_bias", [False, True])
def test_moe_layer_expert_parallel_2_matches_1(expert_bias, dispatcher):
    # megatron-core's own TopKRouter and token dispatcher, unpatched: the CPU mode answers the
    # router's torch.cuda.current_device() and the alltoall dispatcher's torch.cuda.Stream().
    # With expert_bias, finalize_model_grads also moves every router's bias towards balance.
    moe = dataclasses.replace(MOE, expert_bias=expert_bias, dispatcher=dispatcher)
    start = run_distributed(initial_state, 1, moe, timeout=TIMEOUT)[0]
    reference = run_distributed(train, 1, moe, start, timeout=TIMEOUT)[0]
    if expert_bias:
        bias = reference["params"]["decoder.layers.0.mlp.router.expert_bias"]
        assert bias.abs().sum() > 0  # it moved
    run = dataclasses.replace(moe, ep=2)
    _assert_runs_equal(reference, run_distributed(train, 2, run, start, timeout=TIMEOUT))


def test_host_draws_on_tp_rank_0_leave_the_replicas_equal():
    # megatron-core's GPTModel, TP=2, dropout on, 10 steps with a shuffling DataLoader's seed
    # draw on TP rank 0 only (Megatron-LM's data path): every replicated parameter (layer norms,
    # position embeddings, row-parallel biases) stays bitwise equal across the TP ranks, because
    # dropout draws from the device stream, kept apart from host draws (NOTE [ RNG streams ],
    # rule 6). On a CPU, with the CPU generator serving both, the same program drifts; on a GPU
    # dropout draws from CUDA's generator either way, so the control stays equal too.
    run = Run(tp=2, dropout=0.1, steps=10)
    for same in run_distributed(replicas_after_host_draws, 2, run, True, timeout=TIMEOUT):
        assert same and all(same.values()), [n for n, ok in same.items() if not ok]
    control = run_distributed(replicas_after_host_draws, 2, run, False, timeout=TIMEOUT)[0]
    assert all(control.values()) if harness_device_type() == "cuda" else not all(control.values())
