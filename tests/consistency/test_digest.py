"""NOTE [ Check window ], rules 1 and 5-6, on a user's loop: a ColumnParallelLinear ->
RowParallelLinear pair at TP 2, trained with an SGD step per iteration or run forward and
backward only (nothing marks an iteration but the backward passes), and what the default mode
exchanges per iteration once the window has closed.

The last rank is fed a batch of 3 rows instead of 4 from a given iteration on (outside the
window, before the digest, gloo aborted the process at iteration 6), or, in its second
microbatch, a later collective of the forward (a sum over the group after the pair) gets a
[1, 2] tensor instead of [2] (as many elements: gloo runs it, and nothing noticed).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_core import ModelParallelConfig, consistency
from megatron_core import parallel_state as ps
from megatron_core.consistency import RankDisagreementError
from megatron_core.parallel_state import agreement
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    model_parallel_cuda_manual_seed,
    reduce_from_tensor_model_parallel_region,
)
from megatron_core.testing import run_distributed

_HIDDEN = 8


def _counting_exchanges():
    """Count agreement all-gathers (the window's checks, the heads, the digests) per group."""
    counts: dict[str, int] = {}
    original = agreement._all_gather_single

    def counted(output, input_, group=None, async_op=False):
        counts[group.group_name] = counts.get(group.group_name, 0) + 1
        return original(output, input_, group=group, async_op=async_op)

    agreement._all_gather_single = counted
    return counts, lambda: setattr(agreement, "_all_gather_single", original)


def _pair(tp):
    config = ModelParallelConfig(tensor_model_parallel_size=tp)
    init = torch.nn.init.normal_
    column = ColumnParallelLinear(_HIDDEN, 2 * _HIDDEN, config=config, init_method=init)
    row = RowParallelLinear(
        2 * _HIDDEN, _HIDDEN, config=config, init_method=init, input_is_parallel=True,
        skip_bias_add=False, bias=False,
    )  # fmt: skip
    return column, row


def _loop(script: dict):
    """``script``: iterations; loop ("sgd": an optimizer step per iteration, "none": forward
    and backward only, "checkpoint" / "checkpoint_reentrant": the pair under a checkpoint,
    forward and backward only); short (iteration from which the last rank's batch has 3 rows);
    second (iteration where the last rank's second microbatch sums a [1, 2] tensor after the
    pair, the others a [2] one). Returns per
    iteration (iterations seen, agreement exchanges on the TP group), or ("caught",
    iteration, message, optimizer steps made)."""
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(5)
    group = ps.get_tensor_model_parallel_group()
    column, row = _pair(tp)
    params = [*column.parameters(), *row.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    steps, record = [], []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    last = dist.get_rank() == tp - 1
    loop = script.get("loop", "sgd")

    def forward(x, probe):
        out = row(torch.nn.functional.gelu(column(x)[0]))[0]
        return out.sum() + reduce_from_tensor_model_parallel_region(probe).sum()

    counts, restore = _counting_exchanges()
    try:
        with consistency.check_mode(consistency.CheckMode.WINDOW):
            for it in range(1, script["iterations"] + 1):
                try:
                    for microbatch in range(2):
                        short = last and it >= script.get("short", 10**9)
                        x = torch.ones(3 if short else 4, _HIDDEN, requires_grad=True)
                        probe = torch.ones(2)
                        if last and microbatch == 1 and it == script.get("second"):
                            probe = torch.ones(1, 2)
                        if loop.startswith("checkpoint"):
                            reentrant = loop == "checkpoint_reentrant"
                            loss = checkpoint(forward, False, x, probe, use_reentrant=reentrant)
                        else:
                            loss = forward(x, probe)
                        loss.backward()
                    if loop == "sgd":
                        optimizer.step()
                        optimizer.zero_grad()
                except RankDisagreementError as exc:
                    return "caught", it, str(exc), len(steps)
                record.append((consistency.iterations_seen(), counts.get(group.group_name, 0)))
    finally:
        restore()
    return record


def _same_everywhere(results):
    assert all(r == results[0] for r in results), results
    return results[0]


@pytest.mark.parametrize("loop", ["sgd", "none", "checkpoint", "checkpoint_reentrant"])
def test_after_the_window_an_iteration_costs_one_or_two_exchanges_per_group(loop):
    """In the window every collective is agreed: per microbatch Row's forward all-reduce, the
    probe's and Column's backward all-reduce (and, under a reentrant checkpoint, the
    recompute's two). After it an iteration exchanges twice on the TP group: its head and its
    digest. "sgd" is marked at its steps; the other loops mark nothing but their backward
    passes, so each forward and backward is an iteration there (rule 1), and the mark, made at
    the next forward's first collective, agrees that collective (the head) in its digest
    exchange: one exchange per forward and backward."""
    script = {"iterations": 7, "loop": loop}
    record = _same_everywhere(run_distributed(_loop, 2, script, timeout=120))
    exchanges = [count for _, count in record]
    per_iteration = [b - a for a, b in zip([0, *exchanges], exchanges)]
    if loop == "sgd":
        assert [seen for seen, _ in record] == [(i, i) for i in range(1, 8)]
        # iteration 3 is marked at its step: still agreed whole; iteration 4's first check
        # closes the group, its digest follows at the step; then a head and a digest
        assert per_iteration == [6, 6, 6, 2, 2, 2, 2]
        return
    # each microbatch's first forward collective after a backward marks it (the first none)
    assert [seen for seen, _ in record] == [(2 * i - 1, 2 * i - 1) for i in range(1, 8)]
    # loop iteration 2 ends the window (its second microbatch is the third marked iteration,
    # whose first check closes the group); then two microbatches, each one digest and head
    window = [10, 6] if loop == "checkpoint_reentrant" else [6, 4]
    assert per_iteration == window + [2] * 5


@pytest.mark.parametrize("loop", ["sgd", "none", "checkpoint", "checkpoint_reentrant"])
def test_a_batch_cut_differently_late_raises_on_every_rank_instead_of_aborting(loop):
    """The head (rule 6) agrees Row's forward all-reduce of [3, 8] against [4, 8] before it
    runs: every rank raises, no process dies; with an optimizer, before the step."""
    script = {"iterations": 8, "loop": loop, "short": 6}
    kind, where, message, steps = _same_everywhere(run_distributed(_loop, 2, script, timeout=120))
    assert (kind, where, steps) == ("caught", 6, 5 if loop == "sgd" else 0)
    assert message == (
        "consistency check failed before all_reduce on the tensor-model-parallel / "
        "model-parallel group (global ranks [0, 1]): the ranks disagree on shape: rank 0 "
        "(global rank 0) = (4, 8), rank 1 (global rank 1) = (3, 8)"
    )


@pytest.mark.parametrize("loop", ["sgd", "none", "checkpoint", "checkpoint_reentrant"])
def test_a_later_collective_cut_differently_raises_at_the_digest(loop):
    """The probe's sum comes after Row's all-reduce, never a head: [1, 2] against [2] is only
    recorded, and the digest raises on every rank: with an optimizer before iteration 6's
    step; in the other loops when the next forward marks the iteration (forward and backward
    12 of the count is loop iteration 6's second microbatch)."""
    script = {"iterations": 8, "loop": loop, "second": 6}
    kind, where, message, steps = _same_everywhere(run_distributed(_loop, 2, script, timeout=120))
    if loop == "sgd":
        assert (kind, where, steps) == ("caught", 6, 5)
        place, number, total = "before the optimizer step of iteration 6", 5, 6
    else:
        assert (kind, where, steps) == ("caught", 7, 0)
        place, number, total = "at the first collective after the backward of iteration 12", 2, 3
        total += 2 if loop == "checkpoint_reentrant" else 0  # the recompute's two
    assert message == (
        "the iteration digest of the tensor-model-parallel / model-parallel group (global ranks "
        f"[0, 1]) {place} found that the ranks ran different collectives since the last digest "
        f"(every rank raises this error): collective #{number} (all_reduce) of the {total} each "
        "rank ran differs: shape: rank 0 (global rank 0) = (2,), rank 1 (global rank 1) = (1, "
        f"2); in the iteration before, collective #{number} was op all_reduce, shape (2,), dtype "
        "torch.float32 on every rank"
    )


# --- the NCCL path on gloo: the digest's exchange runs on the gloo shadow -------------------


def _through_shadows(bad_iteration: int):
    from megatron_core.parallel_state import groups

    agreement._SHADOW_GLOO_GROUPS = True  # shadow gloo groups too: the NCCL path on this CPU
    counts, restore = _counting_exchanges()
    try:
        pairs = [groups.create_group([low, low + 1]) for low in range(0, dist.get_world_size(), 2)]
        pair = pairs[dist.get_rank() // 2]
        shadow = agreement.host_group(pair)
        last = dist.get_rank() % 2 == 1
        with consistency.check_mode(consistency.CheckMode.WINDOW):
            for it in range(1, 7):
                try:
                    with consistency.iteration():
                        consistency.check_collective("head", pair, torch.zeros(2))
                        rows = 3 if last and it == bad_iteration else 2
                        consistency.check_collective("later", pair, torch.zeros(rows))
                except RankDisagreementError as exc:
                    return it, str(exc), counts.get(pair.group_name, 0), counts[shadow.group_name]
        return None, None, counts.get(pair.group_name, 0), counts[shadow.group_name]
    finally:
        restore()
        agreement._SHADOW_GLOO_GROUPS = False
        agreement._SHADOWS.clear()


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_digest_of_a_device_group_runs_on_its_gloo_shadow(world_size):
    """What NCCL groups get (NOTE [ Host-side agreement ]): every check, head and digest of the
    pair runs on its gloo shadow, none on the pair itself; the digest still names the group."""
    clean = run_distributed(_through_shadows, world_size, 0, timeout=120)
    # 2 + 2 checks in the window, iteration 3's first closes it, then a head and a digest per
    # iteration (3: the digest only): 4 + 1 + 1 + 3 * 2
    assert clean == [(None, None, 0, 12)] * world_size
    for rank, (where, message, on_pair, _) in enumerate(
        run_distributed(_through_shadows, world_size, 5, timeout=120)
    ):
        low = rank - rank % 2
        assert (where, on_pair) == (5, 0)
        assert message.startswith(
            f"the iteration digest of the process group of global ranks [{low}, {low + 1}] at "
            "the end of iteration 5 found"
        ), message
        assert "collective #2 (later) of the 2 each rank ran differs: shape" in message


def _embedding_loop(bad: str):
    """Forward and backward only: an embedding, then a ColumnParallelLinear (whose backward
    all-reduce marks the iterations). At iteration 6 the last rank's ids differ (``bad`` =
    "differ") or every rank's hold an id outside the vocabulary ("outside"): the embedding's
    check is the collective that finds the backward mark due, agreed in its digest exchange."""
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(5)
    config = ModelParallelConfig(tensor_model_parallel_size=tp)
    embedding = VocabParallelEmbedding(
        4 * tp, _HIDDEN, init_method=torch.nn.init.normal_, config=config
    )
    column = ColumnParallelLinear(
        _HIDDEN, 2 * _HIDDEN, config=config, init_method=torch.nn.init.normal_
    )
    last = dist.get_rank() == tp - 1
    with consistency.check_mode(consistency.CheckMode.WINDOW):
        for it in range(1, 9):
            ids = torch.tensor([[0, 1, 2]])
            if it == 6 and (bad == "outside" or last):
                ids = torch.tensor([[0, 1, 4 * tp + 5 if bad == "outside" else 3]])
            try:
                column(embedding(ids))[0].sum().backward()
            except RankDisagreementError as exc:
                return it, str(exc)
    return None


@pytest.mark.parametrize("bad", ["differ", "outside"])
def test_the_head_a_backward_mark_agrees_carries_the_checks_of_the_window(bad):
    results = run_distributed(_embedding_loop, 2, bad, timeout=120)
    where, message = _same_everywhere(results)
    assert where == 6
    if bad == "differ":
        assert message.startswith(
            "consistency check failed before VocabParallelEmbedding on the tensor-model-parallel"
        ), message
        assert "content checksum" in message
    else:
        assert message.startswith("VocabParallelEmbedding failed on 2 of the 2 ranks"), message
        assert "ids [13] are outside [0, vocabulary size (8))" in message
