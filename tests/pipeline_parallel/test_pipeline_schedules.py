"""pipeline_parallel schedules on a toy layer stack: grads vs one process, schedule order, memory.

The model is L tanh(Linear) layers drawn from one seed; virtual stage v (= chunk * pp + stage)
holds layers [v * L / (pp * vp), (v + 1) * L / (pp * vp)). Every configuration is compared with
the whole stack run on one process over the same microbatches. Tolerance: the pipeline does the
same float ops in the same order per microbatch (the split is only where activations cross a
process), and sums the microbatches' gradients in the same order, so the default fp32 tolerance
of assert_close is ample (in practice the results are bitwise equal).
"""

import datetime
import itertools
import time
import types
import weakref

import pytest
import torch
import torch.distributed as dist
from _toy_stack import EVENTS, Chunk, forward_step

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel import (
    P2PCommunicator,
    deallocate_output_tensor,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    interleaved_warmup_microbatches,
)
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.tensor_parallel.recompute.memory import count_saved_activations
from megatron_core.testing import NO_REUSE_ENV, run_distributed

LAYERS, HIDDEN, SEQ, BATCH = 8, 6, 3, 2


def _config(**options):
    base = dict(pipeline_dtype=torch.float32, hidden_size=HIDDEN, sequence_parallel=False)
    base.update(options)
    return types.SimpleNamespace(**base)


def _full_stack(seed: int = 1234) -> list[torch.nn.Linear]:
    """The layers, drawn on the CPU, on this process's device (the schedules receive there)."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)]
    return [layer.to(device.current_device()) for layer in layers]


def _data(m: int, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    dev = device.current_device()
    return [
        (
            i,
            torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dev),
            torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dev),
        )
        for i in range(m)
    ]


def _reference(m: int):
    layers = _full_stack()
    losses = []
    for _, x, target in _data(m):
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = ((h - target) ** 2).mean()
        (loss / m).backward()
        losses.append(loss.detach())
    return layers, losses


def _chunks(config, pp, vp, rank):
    layers = _full_stack()
    per = LAYERS // (pp * vp)
    chunks = []
    for c in range(vp):
        v = c * pp + rank
        last = v == pp * vp - 1
        chunks.append(Chunk(config, layers[v * per : (v + 1) * per], v == 0, c, post_process=last))
    return chunks, per


def _run_config(pp, vp, m, batch_p2p, deallocate, forward_only=False, use_pgc=False):
    """Run one schedule on this rank; return (losses, {global layer index: (w.grad, b.grad)})."""
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
    )
    try:
        rank = parallel_state.get_pipeline_model_parallel_rank()
        config = _config(batch_p2p_comm=batch_p2p, deallocate_pipeline_outputs=deallocate)
        chunks, per = _chunks(config, pp, vp or 1, rank)
        data = [iter(_data(m)) for _ in chunks]
        EVENTS.clear()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data if vp else data[0],
            model=chunks if vp else chunks[0],
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=forward_only,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups() if use_pgc else None,
        )
        grads = {}
        for c, chunk in enumerate(chunks):
            start = (c * pp + rank) * per
            for j, layer in enumerate(chunk.layers):
                if layer.weight.grad is not None:
                    grads[start + j] = (layer.weight.grad.cpu(), layer.bias.grad.cpu())
        return [d["loss"].cpu() for d in losses], grads, list(EVENTS)
    finally:
        parallel_state.destroy_model_parallel()


def _compare_all(cases):
    """Per-rank body: run every case; return its losses/grads for the caller to compare."""
    return [_run_config(*case) for case in cases]


# (pp, vp, m, batch_p2p_comm, deallocate_pipeline_outputs)
CASES = {
    1: [(1, None, 3, True, False)],
    2: [
        (2, None, 4, True, False),
        (2, None, 1, False, True),  # fewer microbatches than stages
        (2, 2, 4, False, False),
        (2, 2, 2, True, True),  # m == pp: every forward in warm-up
        (2, 4, 6, True, True),
    ],
    4: [
        (4, None, 8, True, True),
        (4, None, 2, False, False),
        (4, 2, 8, True, False),
        (4, 2, 4, False, True),
        (2, None, 3, True, False),  # pp=2 x dp=2
        (4, None, 4, True, False, True),  # forward only
        (4, 2, 4, True, True, True, True),  # forward only, groups from a ProcessGroupCollection
        (4, None, 5, False, False, False, True),
    ],
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_schedules_match_one_process(world_size):
    per_rank = run_distributed(_compare_all, world_size, CASES[world_size], timeout=120)
    for index, (pp, vp, m, *flags) in enumerate(CASES[world_size]):
        forward_only = len(flags) > 2 and flags[2]
        ref_layers, ref_losses = _reference(m)
        seen = set()
        for rank in range(world_size):
            losses, grads, _ = per_rank[rank][index]
            stage = rank // (world_size // pp)  # order tp-cp-ep-dp-pp: pp is the slowest
            if stage == pp - 1:  # the last stage reports the losses, in microbatch order
                torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
            else:
                assert losses == []
            if forward_only:
                assert grads == {}
                seen.update(range(LAYERS))
            for i, (w, b) in grads.items():
                torch.testing.assert_close(w, ref_layers[i].weight.grad)
                torch.testing.assert_close(b, ref_layers[i].bias.grad)
                seen.add(i)
        assert seen == set(range(LAYERS)), (pp, vp, m)


# --- schedule order vs Narayanan et al. 2021, Fig. 4 (pp=4, m=8; 1-based microbatches) ---------

# 1F1B: device d runs 4 - d warm-up forwards, then alternates, then drains.
PAPER_1F1B = {
    0: "F1 F2 F3 F4 B1 F5 B2 F6 B3 F7 B4 F8 B5 B6 B7 B8",
    1: "F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 F8 B6 B7 B8",
    2: "F1 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 F8 B7 B8",
    3: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8",
}
# Interleaved, 2 chunks per device: "a" is the device's first chunk, "b" its second.
PAPER_INTERLEAVED = {
    0: "F1a F2a F3a F4a F1b F2b F3b F4b F5a F6a F7a B1b F8a B2b F5b B3b F6b B4b F7b B1a F8b B2a "
    "B3a B4a B5b B6b B7b B8b B5a B6a B7a B8a",
    1: "F1a F2a F3a F4a F1b F2b F3b F4b F5a B1b F6a B2b F7a B3b F8a B4b F5b B1a F6b B2a F7b B3a "
    "F8b B4a B5b B6b B7b B8b B5a B6a B7a B8a",
    2: "F1a F2a F3a F4a F1b F2b F3b B1b F4b B2b F5a B3b F6a B4b F7a B1a F8a B2a F5b B3a F6b B4a "
    "F7b B5b F8b B6b B7b B8b B5a B6a B7a B8a",
    3: "F1a F2a F3a F4a F1b B1b F2b B2b F3b B3b F4b B4b F5a B1a F6a B2a F7a B3a F8a B4a F5b B5b "
    "F6b B6b F7b B7b F8b B8b B5a B6a B7a B8a",
}


def _order(events):
    return " ".join(f"{kind}{i + 1}" + ("ab"[c] if c is not None else "") for kind, i, c in events)


def _schedule_order(vp):
    losses, grads, events = _run_config(4, vp, 8, True, False)
    if vp is None:
        events = [(kind, i, None) for kind, i, _ in events]
    return events


def test_1f1b_order_matches_paper():
    per_rank = run_distributed(_schedule_order, 4, None, timeout=60)
    for rank, events in enumerate(per_rank):
        assert _order(events) == PAPER_1F1B[rank], rank


def test_interleaved_order_matches_paper():
    per_rank = run_distributed(_schedule_order, 4, 2, timeout=60)
    for rank, expected in PAPER_INTERLEAVED.items():
        assert _order(per_rank[rank]) == expected, rank
    for events in per_rank:  # every stage runs every (microbatch, chunk) once each way
        assert sorted(events) == sorted(
            (k, i, c) for k, i, c in itertools.product("BF", range(8), range(2))
        )


def test_interleaved_warmup_counts():
    # NOTE [ Interleaved 1F1B ], rule 2: (pp - r - 1) * 2 + (vp - 1) * pp, capped at m * vp.
    assert [interleaved_warmup_microbatches(8, 4, r, 2) for r in range(4)] == [10, 8, 6, 4]
    assert interleaved_warmup_microbatches(4, 4, 0, 2) == 8  # m == pp: all warm-up on stage 0
    assert interleaved_warmup_microbatches(4, 4, 3, 2) == 4  # ... not on the last stage
    assert interleaved_warmup_microbatches(8, 4, 0, 2, forward_only=True) == 16


# --- bad input and failures ------------------------------------------------------------------


def _bad_input(case):
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=case.get("vp")
    )
    rank = parallel_state.get_pipeline_model_parallel_rank()
    vp = case.get("vp") or 1
    chunks, _ = _chunks(_config(**case.get("config", {})), 2, vp, rank)
    kwargs = dict(
        forward_step_func=forward_step,
        data_iterator=[iter(_data(4)) for _ in chunks] if case.get("vp") else iter(_data(4)),
        model=chunks if case.get("vp") else chunks[0],
        num_microbatches=4,
        seq_length=SEQ,
        micro_batch_size=BATCH,
    )
    kwargs.update(case.get("kwargs", {}))
    try:
        get_forward_backward_func()(**kwargs)
    except MegatronCoreError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "case, message",
    [
        ({"vp": 2, "kwargs": {"num_microbatches": 3}}, r"num_microbatches \(3\) mod"),
        ({"config": {"pipeline_dtype": None}}, r"pipeline_dtype must be set"),
        ({"kwargs": {"num_microbatches": 0}}, r"num_microbatches \(0\) must be >= 1"),
        ({"kwargs": {"seq_length": None}}, r"seq_length \(None\) must be an int"),
        ({"vp": 2, "kwargs": {"data_iterator": None}}, r"one iterator per model chunk \(2\)"),
    ],
)
def test_bad_input_raises_before_communication(case, message):
    # Both ranks must raise the same error; a rank that reached a p2p call would hang the other
    # until the timeout, so finishing well within it shows no communication was attempted.
    import re

    for error in run_distributed(_bad_input, 2, case, timeout=30):
        assert error is not None and re.search(message, error), error


def test_get_forward_backward_func_picks_schedule():
    assert get_forward_backward_func(1, None) is forward_backward_no_pipelining
    assert get_forward_backward_func(2, None) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is forward_backward_pipelining_with_interleaving


def test_deallocate_output_tensor():
    x = torch.randn(4, 5, requires_grad=True)
    out = x * 2
    deallocate_output_tensor(out, deallocate_pipeline_outputs=False)
    assert out.shape == (4, 5)
    deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
    assert out.numel() == 1 and out.grad_fn is not None
    with pytest.raises(MegatronCoreError, match="view"):
        deallocate_output_tensor(out.view(1, 1), deallocate_pipeline_outputs=True)


def _failing_stage(fail_rank):
    """The stage fail_rank raises in its forward; the other stage must not hang in p2p."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    config = _config()
    chunks, _ = _chunks(config, 2, 1, rank)
    p2p = P2PCommunicator(
        parallel_state.get_pipeline_model_parallel_group(),
        config,
        timeout=datetime.timedelta(seconds=3),
    )

    def failing_forward_step(data_iterator, model):
        if rank == fail_rank:
            raise ValueError(f"stage {rank} failed on purpose")
        return forward_step(data_iterator, model)

    start = time.monotonic()
    try:
        forward_backward_pipelining_without_interleaving(
            forward_step_func=failing_forward_step,
            data_iterator=iter(_data(4)),
            model=chunks[0],
            num_microbatches=4,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            p2p_communicator=p2p,
        )
    except (MegatronCoreError, ValueError) as error:
        return type(error).__name__, time.monotonic() - start, str(error)
    return None


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_failing_stage_does_not_hang_its_peer(fail_rank, monkeypatch):
    monkeypatch.setenv(NO_REUSE_ENV, "1")  # the peer's timed-out pair is closed by gloo
    results = run_distributed(_failing_stage, 2, fail_rank, timeout=60)
    kind, _, message = results[fail_rank]
    assert kind == "ValueError" and "failed on purpose" in message
    kind, elapsed, message = results[1 - fail_rank]
    assert kind == "MegatronCoreError" and "pipeline p2p" in message, message
    assert 2.5 < elapsed < 30, elapsed  # it waited its 3 s timeout, then raised


def _peer_times_out():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    p2p = P2PCommunicator(
        parallel_state.get_pipeline_model_parallel_group(),
        _config(),
        timeout=datetime.timedelta(seconds=2),
    )
    if p2p.is_pp_first_stage:
        return "skipped"  # the first stage never sends: its peer waits for nothing
    start = time.monotonic()
    try:
        p2p.recv_forward((SEQ, BATCH, HIDDEN), is_first_stage=False)
    except MegatronCoreError as error:
        return time.monotonic() - start, str(error)
    return None


def test_recv_without_sender_raises_within_timeout(monkeypatch):
    # gloo closes a pair whose receive timed out: these workers must not serve later tests.
    monkeypatch.setenv(NO_REUSE_ENV, "1")
    first, last = run_distributed(_peer_times_out, 2, timeout=60)
    assert first == "skipped"
    elapsed, message = last
    assert 1.5 < elapsed < 20, elapsed
    assert "recv from prev rank 0" in message


def _exchange(batch_p2p):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=dist.get_world_size())
    p2p = P2PCommunicator(
        parallel_state.get_pipeline_model_parallel_group(), _config(batch_p2p_comm=batch_p2p)
    )
    r = p2p.pp_rank
    act = torch.full((SEQ, BATCH, HIDDEN), float(r))
    grad = torch.full((SEQ, BATCH, HIDDEN), 100.0 + r)
    got_prev, got_next = p2p.send_forward_backward_recv_forward_backward(
        act, grad, True, True, (SEQ, BATCH, HIDDEN)
    )
    return got_prev[0, 0, 0].item(), got_next[0, 0, 0].item(), got_prev.requires_grad


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("batch_p2p", [True, False])
def test_ring_exchange_both_directions(world_size, batch_p2p):
    # With 2 stages both neighbours are one rank: activations and gradients must not swap
    # (NOTE [ P2P matching ], rule 2).
    for r, (prev, nxt, requires_grad) in enumerate(
        run_distributed(_exchange, world_size, batch_p2p, timeout=60)
    ):
        assert prev == float((r - 1) % world_size)
        assert nxt == 100.0 + (r + 1) % world_size
        assert requires_grad


# --- activation memory: in-flight microbatches per schedule -------------------------------------


def _one_microbatch_bytes(chunk, x, target) -> int:
    """Saved bytes of one microbatch's forward (and loss, on the last stage) through ``chunk``."""
    if not chunk.pre_process:
        received = torch.randn(SEQ, BATCH, HIDDEN, device=x.device, requires_grad=True)
        chunk.set_input_tensor([received])
    with count_saved_activations(ignore=chunk.parameters()) as report:
        out = chunk(x)
        if chunk.post_process:
            ((out - target) ** 2).mean()
    return report.total_bytes


def _peak_in_flight(pp, ms):
    """Per m: (peak saved bytes during 1F1B on this stage in units of one microbatch's bytes,
    bytes still held after the step)."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    (chunk,), _ = _chunks(_config(deallocate_pipeline_outputs=True), pp, 1, rank)
    _, x, target = _data(1)[0]
    per_microbatch = _one_microbatch_bytes(chunk, x, target)
    results = []
    for m in ms:
        with count_saved_activations(ignore=chunk.parameters()) as report:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(_data(m)),
                model=chunk,
                num_microbatches=m,
                seq_length=SEQ,
                micro_batch_size=BATCH,
            )
        results.append((report.peak_held_bytes / per_microbatch, report.held_bytes))
    return results


@pytest.mark.parametrize("world_size, ms", [(1, [6]), (2, [6]), (4, [8, 2])])
def test_1f1b_keeps_at_most_pp_microbatches_in_flight(world_size, ms):
    # NOTE [ 1F1B ], rule 3: stage r holds min(pp - r, m) microbatches' activations at its peak,
    # however many microbatches the step has (no pipelining: one at a time).
    per_rank = run_distributed(_peak_in_flight, world_size, world_size, ms, timeout=60)
    for rank, results in enumerate(per_rank):
        for m, (in_flight, held_after) in zip(ms, results):
            assert in_flight == min(world_size - rank, m), (rank, m, in_flight)
            assert held_after == 0  # every microbatch's graph was freed by its backward


def _finished_microbatches_alive(pp, m):
    """At each forward step of this stage: how many microbatches whose backward already ran
    still have their output, their received input or its gradient (sent back) alive (weak
    references taken as the schedule hands them over, the gradient as its backward returns it)."""
    from megatron_core.pipeline_parallel import _one_f_one_b

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    (chunk,), _ = _chunks(_config(), pp, 1, rank)
    refs, alive = {"input": [], "output": [], "input grad": []}, []
    set_input, backward = chunk.set_input_tensor, _one_f_one_b.backward_step

    def keep_reference(tensors):
        if tensors[0] is not None:
            refs["input"].append(weakref.ref(tensors[0]))
        set_input(tensors)

    def backward_step(*args, **kwargs):
        grads = backward(*args, **kwargs)
        if grads[0] is not None:
            refs["input grad"].append(weakref.ref(grads[0]))
        return grads

    def step(data_iterator, model):
        done = sum(event[0] == "B" for event in EVENTS)  # backwards that ran so far
        alive.append(sum(ref() is not None for kind in refs.values() for ref in kind[:done]))
        out, loss_func = forward_step(data_iterator, model)
        refs["output"].append(weakref.ref(out))
        return out, loss_func

    chunk.set_input_tensor = keep_reference
    _one_f_one_b.backward_step = backward_step
    EVENTS.clear()
    try:
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(_data(m)), model=chunk,
            num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
    finally:
        _one_f_one_b.backward_step = backward
    return alive


@pytest.mark.parametrize("world_size", [2, 4])
def test_1f1b_drops_a_microbatch_after_its_backward(world_size):
    # NOTE [ Pipeline outputs ], rule 5: once backward k ran, microbatch k's output (its graph),
    # received input and the input's gradient are gone on every stage: neither the warm-up's
    # last forward nor the steady loop's last microbatch nor its sent gradient stays referenced
    # through the next forwards.
    per_rank = run_distributed(_finished_microbatches_alive, world_size, world_size, 6, timeout=60)
    assert per_rank == [[0] * 6] * world_size


def _bad_send():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    p2p = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), _config())
    if not p2p.is_pp_first_stage:
        return None  # the first stage must fail before posting anything: nothing to receive
    errors = []
    for tensor, shape in (
        (torch.zeros(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16), None),
        (torch.zeros(SEQ, BATCH, HIDDEN + 1), (SEQ, BATCH, HIDDEN)),
    ):
        try:
            p2p.send_forward_recv_backward(tensor, shape or (SEQ, BATCH, HIDDEN), False)
        except MegatronCoreError as error:
            errors.append(str(error))
    return errors


def test_sent_tensor_must_match_pipeline_dtype_and_shape():
    errors, _ = run_distributed(_bad_send, 2, timeout=30)
    assert "dtype torch.bfloat16 but config.pipeline_dtype is torch.float32" in errors[0]
    assert "shape (3, 2, 7) but the pipeline's tensor_shape is (3, 2, 6)" in errors[1]


# --- finalize_model_grads ---------------------------------------------------------------------


def _finalize(pp, tokens_by_rank):
    from megatron_core.distributed import finalize_model_grads

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    rank = dist.get_rank()
    module = torch.nn.Linear(2, 1, bias=False)
    module.weight.grad = torch.full((1, 2), float(rank + 1))
    num_tokens = None if tokens_by_rank is None else torch.tensor(tokens_by_rank[rank])
    finalize_model_grads([module], num_tokens)
    return module.weight.grad[0, 0].item()


@pytest.mark.parametrize(
    "world_size, pp, tokens, expected",
    [
        (2, 1, None, [1.5, 1.5]),  # dp=2: averaged
        (2, 1, [3, 5], [3 / 8, 3 / 8]),  # per-token: summed over DP, / all tokens
        (2, 2, [0, 4], [1 / 4, 2 / 4]),  # pp=2: the last stage's count reaches the first
        (4, 2, [0, 0, 2, 6], [3 / 8, 3 / 8, 7 / 8, 7 / 8]),  # pp=2 x dp=2: DP [0,1] [2,3]
    ],
)
def test_finalize_model_grads_dp_and_num_tokens(world_size, pp, tokens, expected):
    # NOTE [ Gradient finalization ], rules 2 and 4 (grads are small integers: exact).
    assert run_distributed(_finalize, world_size, pp, tokens, timeout=60) == expected


def test_gloo_p2p_stages_device_tensors_through_host_memory(monkeypatch):
    # NOTE [ P2P matching ], rule 6. A device tensor is stood in for by a meta tensor here (this
    # machine may have no GPU): its receive gets a CPU buffer; CPU tensors go on the wire as is.
    from megatron_core.pipeline_parallel import _p2p_ops

    monkeypatch.setattr(_p2p_ops.dist, "get_backend", lambda group=None: "gloo")
    on_device = torch.empty(2, 3, dtype=torch.bfloat16, device="meta")
    on_host = torch.ones(4)
    names = ["send_next", "recv_prev"]
    wire = _p2p_ops._host_staged({"send_next": on_host, "recv_prev": on_device}, names, None)
    assert wire["send_next"] is on_host
    staged = wire["recv_prev"]
    assert (staged.device.type, staged.shape, staged.dtype) == ("cpu", (2, 3), torch.bfloat16)
    monkeypatch.setattr(_p2p_ops.dist, "get_backend", lambda group=None: "cuda:nccl,cpu:gloo")
    wire = _p2p_ops._host_staged({"send_next": on_host, "recv_prev": on_device}, names, None)
    assert wire["recv_prev"] is on_device  # NCCL carries device tensors itself

    class _Done:
        def wait(self, timeout=None):
            return True

    target, arrived = torch.zeros(3, requires_grad=True), torch.arange(3.0)  # a received leaf
    receive = _p2p_ops.Request(_Done(), "recv", None, target, staged=arrived, receive=True)
    receive.wait()
    assert torch.equal(target.detach(), arrived)  # the staged receive lands in the tensor
    sent, copy = torch.ones(3), torch.full((3,), 7.0)
    send = _p2p_ops.Request(_Done(), "send", None, sent, staged=copy)
    assert send.staged is copy  # the host copy on the wire lives until the send is done
    send.wait()
    assert torch.equal(sent, torch.ones(3)) and send.staged is None
