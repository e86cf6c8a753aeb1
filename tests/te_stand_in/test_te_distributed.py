"""``transformer_engine.pytorch.distributed`` on the stand-in: Transformer Engine's
``checkpoint`` (keyword options, the pre-1.5 positional form, reentrant with distributed saved
activations, non-reentrant) recomputes bitwise what the plain call computes, dropout included
(the recompute replays this package's RNG tracker); its ``CudaRNGStatesTracker`` is that tracker,
publishing its streams to ``get_all_rng_states``. Run on 2 ranks (the distributed first input is
split over them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _te_checks import Report, assert_topic, leaf, randn

from megatron_core import parallel_state
from megatron_core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_core.testing import run_distributed
from megatron_core.transformer_engine.pytorch import distributed as te_distributed


def _region(x, weight, scale=1.0):
    """A region with a dropout drawn from the tracker's stream."""
    with get_cuda_rng_tracker().fork():
        return F.dropout(torch.tanh(x @ weight) * scale, p=0.5)


def _run(call):
    model_parallel_cuda_manual_seed(42)
    x, w = leaf(randn(8, 4, seed=1)), leaf(randn(4, 4, seed=2))
    out = call(x, w)
    out.backward(randn(*out.shape, seed=3))
    return out.detach(), x.grad, w.grad


def checkpoint_report() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    report = Report()
    report.topic = "checkpoint"
    plain = _run(lambda x, w: _region(x, w, scale=2.0))
    group = parallel_state.get_tensor_model_parallel_group()
    checkpoint = te_distributed.checkpoint
    variants = {
        "keywords, distributed": lambda x, w: checkpoint(
            _region, x, w, scale=2.0, distribute_saved_activations=True,
            get_rng_state_tracker=get_cuda_rng_tracker, tp_group=group,
        ),
        "positional (TE < 1.5)": lambda x, w: checkpoint(
            lambda a, b: _region(a, b, scale=2.0), False, get_cuda_rng_tracker, None, x, w
        ),
        "non-reentrant": lambda x, w: checkpoint(_region, x, w, scale=2.0, use_reentrant=False),
    }  # fmt: skip
    for name, call in variants.items():
        got = _run(call)
        for i, what in enumerate(("output", "input grad", "weight grad")):
            report.close(f"{name} {what}", got[i], plain[i], rtol=0, atol=0)
    other = te_distributed.CudaRNGStatesTracker
    report.raises(
        "another tracker",
        lambda: checkpoint(
            _region, randn(8, 4, seed=1), randn(4, 4, seed=2), get_rng_state_tracker=other
        ),  # fmt: skip
        "get_rng_state_tracker",
    )
    report.topic = "tracker"
    tracker = te_distributed.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 77)
    report.true("published", set(te_distributed.get_all_rng_states()) == {"model-parallel-rng"})
    with tracker.fork():
        first = torch.rand(3)
    tracker.reset()
    tracker.add("model-parallel-rng", 77)
    with tracker.fork():
        report.close("a fork draws from its seed", torch.rand(3), first, rtol=0, atol=0)
    return report.result()


@pytest.mark.parametrize("topic", ["checkpoint", "tracker"])
def test_te_checkpoint_and_tracker(topic):
    assert_topic(run_distributed(checkpoint_report, 2, timeout=120), topic)
