"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy on the gathered logits.

Every rank builds the same full logits [s, b, V] and targets from fixed seeds, keeps its vocabulary
slice, and compares loss and gradient with torch's per-token loss (reduction="none") on the full
logits (megatron-core's smoothing e is torch's e * V / (V - 1)), for label_smoothing in {0, 0.1}
x ignore_index absent / present (out of vocabulary, -100, and inside the vocabulary).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state as ps
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import vocab_parallel_cross_entropy
from megatron_core.testing import run_distributed

S, B, V = 4, 3, 16  # V divisible by 1, 2, 4
CONFIGS = {1: [1], 2: [2], 4: [4, 2]}  # world size -> tensor-parallel sizes run there

# The loss is fp32 from the same inputs in both cases; only the order of the vocabulary sums
# differs (per rank, then across ranks), so fp32 rounding is all that separates them: 1e-5.
# bf16 logits: the computation still runs in fp32 from the same bf16 values, so the loss keeps the
# fp32 tolerance; the gradient is rounded to bf16 (8 significant bits, |grad| <= 1): 1e-2.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"float32": {"rtol": 1e-5, "atol": 1e-6}, "bfloat16": {"rtol": 1e-2, "atol": 1e-2}}

# (label_smoothing, ignore_index, how many targets are set to ignore_index)
CASES = [(eps, ii, n) for eps in (0.0, 0.1) for ii, n in ((-100, 0), (-100, 4), (5, 3))]


def _inputs(dtype, ignore_index, n_ignored):
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(S, B, V, generator=gen) * 3).to(dtype)
    target = torch.randint(0, V, (S, B), generator=gen)
    target.view(-1)[torch.randperm(S * B, generator=gen)[:n_ignored]] = ignore_index
    grad = torch.rand(S, B, generator=gen) + 0.5
    return logits, target, grad


def _reference(logits, target, grad, eps, ignore_index):
    # megatron-core's smoothing (e / (V - 1) on each non-target class) = torch's e * V / (V - 1).
    full = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(
        full.flatten(0, 1),
        target.flatten(),
        label_smoothing=eps * V / (V - 1),
        ignore_index=ignore_index,
        reduction="none",
    ).view(S, B)
    loss.backward(grad)
    return loss.detach(), full.grad


def _check_against_torch(r, w, dtype_name):
    dtype = getattr(torch, dtype_name)
    for eps, ignore_index, n_ignored in CASES:
        logits, target, grad = _inputs(dtype, ignore_index, n_ignored)
        ref_loss, ref_grad = _reference(logits, target, grad, eps, ignore_index)
        shard = logits.chunk(w, dim=-1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, eps, ignore_index=ignore_index)
        assert loss.dtype == torch.float32 and loss.shape == target.shape
        torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
        assert torch.all(loss[target == ignore_index] == 0)
        loss.backward(grad)
        assert shard.grad.dtype == dtype
        expected = ref_grad.chunk(w, dim=-1)[r]
        torch.testing.assert_close(shard.grad.float(), expected, **GRAD_TOL[dtype_name])
        assert torch.all(shard.grad[target == ignore_index] == 0)
        # An expanded incoming gradient (sum) gives the same result as feeding ones.
        shard.grad = None
        vocab_parallel_cross_entropy(shard, target, eps, ignore_index=ignore_index).sum().backward()
        _, ones_grad = _reference(logits, target, torch.ones(S, B), eps, ignore_index)
        torch.testing.assert_close(
            shard.grad.float(), ones_grad.chunk(w, dim=-1)[r], **GRAD_TOL[dtype_name]
        )


def _check_errors(w):
    logits = torch.zeros(S, B, V // w)
    target = torch.zeros(S, B, dtype=torch.long)
    with pytest.raises(MegatronCoreError, match=r"target shape \(4,\)"):
        vocab_parallel_cross_entropy(logits, target[:, 0])
    with pytest.raises(MegatronCoreError, match=r"target dtype \(torch.float32\)"):
        vocab_parallel_cross_entropy(logits, target.float())
    with pytest.raises(MegatronCoreError, match=r"label_smoothing \(1.5\)"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(MegatronCoreError, match=r"label_smoothing \(1.0\) must be in \[0, 1\)"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    bad = target.clone()
    bad[0, 0] = V
    with pytest.raises(MegatronCoreError, match=rf"\[{V}\] are outside \[0, vocab size \({V}\)\)"):
        vocab_parallel_cross_entropy(logits, bad)


def _body(tp_sizes, dtype_name):
    for tp in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        r, w = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        _check_against_torch(r, w, dtype_name)
        _check_errors(w)
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_matches_torch_cross_entropy(world_size, dtype_name):
    results = run_distributed(_body, world_size, CONFIGS[world_size], dtype_name, timeout=120)
    assert results == [True] * world_size


def test_label_smoothing_is_megatron_cores_definition():
    """From the definition: the target keeps 1 - e, every other class gets e / (V - 1)."""
    run_distributed(_smoothing_definition, 1)


def _smoothing_definition():
    ps.initialize_model_parallel()
    eps = 0.2
    logits, target, _ = _inputs(torch.float32, -100, 0)
    log_probs = logits.log_softmax(-1)
    weights = torch.full_like(logits, eps / (V - 1))
    weights.scatter_(-1, target.unsqueeze(-1), 1.0 - eps)
    expected = -(weights * log_probs).sum(-1)
    loss = vocab_parallel_cross_entropy(logits.clone(), target, eps)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # torch's own convention (e / V on every class) differs: the test can tell them apart.
    torch_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=eps)
    assert not torch.allclose(loss.mean(), torch_loss, rtol=1e-5, atol=1e-6)


def test_explicit_tp_group_is_used_instead_of_parallel_state(monkeypatch):
    # megatron-core 0.19: vocab_parallel_cross_entropy(..., tp_group=g) reads the group's own
    # rank() and size() (any object with them) and never asks parallel_state for one.
    from megatron_core.tensor_parallel import cross_entropy

    class OneRankGroup:
        def rank(self):
            return 0

        def size(self):
            return 1

    def no_parallel_state():
        raise AssertionError("an explicit tp_group must not read parallel_state")

    monkeypatch.setattr(cross_entropy, "get_tensor_model_parallel_group", no_parallel_state)
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -0.5, 1.0]])
    target = torch.tensor([2, 0])
    loss = vocab_parallel_cross_entropy(logits, target, tp_group=OneRankGroup())
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, reduction="none"))
    with pytest.raises(AssertionError, match="must not read parallel_state"):
        vocab_parallel_cross_entropy(logits, target)  # no group: parallel_state's, looked up
