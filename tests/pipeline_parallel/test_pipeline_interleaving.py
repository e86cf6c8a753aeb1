"""Interleaved schedule options against megatron-core 0.16.1: order, overlap, groups, lengths.

A stack of LAYERS tanh(Linear) layers is split over pp stages x vp chunks (virtual stage
``c * pp + r`` holds a contiguous slice). Every configuration trains STEPS steps of SGD and is
compared with the whole stack on one process over the same microbatches: losses per step, final
gradients and weights. Tolerance 1e-5: the pipeline runs the same float ops per microbatch and
sums microbatch gradients in the same order, so results are equal up to reassociation-free
rounding (in practice bitwise). The order each stage runs its (microbatch, chunk) forwards and
backwards is compared with the order megatron-core's own pure ``get_schedule_table`` and
``get_pp_rank_microbatches`` give.
"""

import inspect
import types

import pytest
import torch
from _toy_stack import EVENTS, Chunk, forward_step

from megatron_core import device, parallel_state
from megatron_core.megatron import megatron_core_version
from megatron_core.pipeline_parallel import (
    get_forward_backward_func,
    interleaved_chunk_order,
    schedules,
)
from megatron_core.testing import run_distributed

LAYERS, HIDDEN, BATCH, SEQ, STEPS, LR = 24, 4, 2, 3, 2, 0.1


def _seq(i: int, variable: bool) -> int:
    return 2 + i % 3 if variable else SEQ


def _data(m: int, step: int, variable: bool):
    g = torch.Generator().manual_seed(1000 * step + m)
    out = []
    for i in range(m):
        s = _seq(i, variable)
        out.append(
            (
                i,
                torch.randn(s, BATCH, HIDDEN, generator=g).to(device.current_device()),
                torch.randn(s, BATCH, HIDDEN, generator=g).to(device.current_device()),
            )
        )
    return out


def _stack():
    """The layers, drawn on the CPU, on this process's device (the schedules receive there)."""
    torch.manual_seed(7)
    return [torch.nn.Linear(HIDDEN, HIDDEN).to(device.current_device()) for _ in range(LAYERS)]


def _reference(m: int, variable: bool, forward_only: bool = False):
    layers = _stack()
    losses = []
    for step in range(STEPS):
        for layer in layers:
            layer.zero_grad()
        step_losses = []
        for _, x, target in _data(m, step, variable):
            h = x
            for layer in layers:
                h = torch.tanh(layer(h))
            loss = ((h - target) ** 2).mean()
            (loss / m).backward()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses))
        if step < STEPS - 1 and not forward_only:
            with torch.no_grad():
                for p in (p for layer in layers for p in layer.parameters()):
                    p -= LR * p.grad
    return losses, layers


def _config(case):
    return types.SimpleNamespace(
        pipeline_dtype=None if case.get("dtype_missing") else torch.float32,
        hidden_size=HIDDEN,
        sequence_parallel=False,
        batch_p2p_comm=case.get("batch", not case.get("overlap", False)),
        overlap_p2p_comm=case.get("overlap", False),
        overlap_p2p_comm_warmup_flush=case.get("flush", False),
        microbatch_group_size_per_vp_stage=case.get("group"),
        variable_seq_lengths=case.get("variable", False),
        deallocate_pipeline_outputs=case.get("deallocate", True),
    )


def _run(case):
    """Per-rank body: STEPS steps of one configuration; (losses, {layer: tensors}, events)."""
    pp, vp, m = case["pp"], case.get("vp"), case["m"]
    variable, forward_only = case.get("variable", False), case.get("forward_only", False)
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
    )
    rank = parallel_state.get_pipeline_model_parallel_rank()
    layers, per = _stack(), LAYERS // (pp * (vp or 1))
    config = _config(case)
    owned = {}
    chunks = []
    for c in range(vp or 1):
        v = c * pp + rank
        chunks.append(Chunk(config, layers[v * per : (v + 1) * per], v == 0, c))
        owned.update({v * per + j: layer for j, layer in enumerate(chunks[-1].layers)})
    if case.get("sync"):  # record megatron-core DDP's overlap hooks as events
        owner = {id(next(chunk.parameters())): c for c, chunk in enumerate(chunks)}
        config.grad_sync_func = lambda params: EVENTS.append(("G", owner[id(next(params))]))
        config.param_sync_func = lambda params: EVENTS.append(("P", owner[id(next(params))]))
    losses, events = [], None
    for step in range(STEPS):
        for layer in owned.values():
            layer.zero_grad()
        EVENTS.clear()
        data = [iter(_data(m, step, variable)) for _ in chunks]
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data if vp else data[0],
            model=chunks if vp else chunks[0],
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=forward_only,
        )
        losses.append([d["loss"].cpu() for d in out])
        events = events or list(EVENTS)
        if step < STEPS - 1 and not forward_only:
            with torch.no_grad():
                for p in (p for layer in owned.values() for p in layer.parameters()):
                    p -= LR * p.grad

    def cpu(t):  # results meet CPU references in the test process
        return None if t is None else t.detach().cpu()

    grads = {
        i: tuple(map(cpu, (layer.weight.grad, layer.bias.grad, layer.weight, layer.bias)))
        for i, layer in owned.items()
    }
    return losses, grads, events


def _run_all(cases):
    results = []
    for case in cases:
        try:
            results.append(_run(case))
        finally:
            parallel_state.destroy_model_parallel()
    return results


CASES = {
    2: [
        dict(pp=2, vp=2, m=4, overlap=True),
        dict(pp=2, vp=2, m=5, group=3, overlap=True, flush=True),  # m not divisible by pp
        dict(pp=2, vp=2, m=3, group=3, variable=True),
        dict(pp=2, vp=2, m=4, overlap=True, variable=True, deallocate=False),
        dict(pp=2, vp=3, m=2, overlap=True, flush=True),  # m == pp: stage 0 all warm-up
        dict(pp=2, vp=2, m=6, group=4, batch=True),
        dict(pp=2, m=3, variable=True),  # 1F1B, shapes exchanged
        dict(pp=2, vp=2, m=4, overlap=True, flush=True, forward_only=True),
        dict(pp=2, vp=3, m=4, sync=True),  # grad / param sync hooks per chunk
        dict(pp=2, m=3, sync=True),
    ],
    4: [
        dict(pp=4, vp=2, m=8, overlap=True),
        dict(pp=4, vp=2, m=10, group=5, overlap=True, flush=True),  # the example
        dict(pp=4, vp=2, m=6, group=6),
        dict(pp=4, vp=2, m=5, group=5, overlap=True, variable=True),
        dict(pp=4, m=5, variable=True),
    ],
}


def _expected_order(case, rank):
    """The stage's event order from megatron-core's own (pure) schedule functions."""
    pytest.importorskip("megatron.core", reason="the [megatron] extra (megatron-core)")
    from megatron.core.pipeline_parallel import schedules as mcore

    pp, vp, m = case["pp"], case.get("vp"), case["m"]
    group = case.get("group") or pp
    if vp is None:
        fwd = [("F", i, 0) for i in range(m)]
        bwd = [("B", i, 0) for i in range(m)]
        warmup = min(pp - rank - 1, m)
    else:
        table = mcore.get_schedule_table(m, vp, group)
        fake = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(size=lambda: pp, rank=lambda: rank),
            virtual_pipeline_model_parallel_size=vp,
        )
        _, _, warmup, _ = mcore.get_pp_rank_microbatches(
            m, vp, group, forward_only=case.get("forward_only", False), p2p_communicator=fake
        )
        fwd = [("F", i, c) for i, c in table]
        bwd = [("B", i, vp - 1 - c) for i, c in table]
    if case.get("forward_only"):
        return fwd
    steady = [e for pair in zip(fwd[warmup:], bwd) for e in pair]
    return fwd[:warmup] + steady + bwd[len(fwd) - warmup :]


def _check_sync_hooks(case, rank, events):
    """megatron-core's timing of grad_sync_func / param_sync_func (schedules.py, 0.16.1)."""
    vp = case.get("vp")
    if vp is None:  # 1F1B: stage 0 lets its last backward sync; the others call the hook last
        assert [e for e in events if e[0] in "GP"] == ([] if rank == 0 else [("G", 0)])
        if rank:
            assert events[-1] == ("G", 0)
        return
    for c in range(vp):
        grads = [i for i, e in enumerate(events) if e == ("G", c)]
        params = [i for i, e in enumerate(events) if e == ("P", c)]
        backwards = [i for i, e in enumerate(events) if e[0] == "B" and e[2] == c]
        forwards = [i for i, e in enumerate(events) if e[0] == "F" and e[2] == c]
        assert len(grads) == 1 and grads[0] > max(backwards), (rank, c, events)
        assert len(params) == 1 and params[0] < min(forwards), (rank, c, events)


@pytest.mark.parametrize("world_size", [2, 4])
def test_options_match_one_process_and_megatron_order(world_size):
    cases = CASES[world_size]
    per_rank = run_distributed(_run_all, world_size, cases, timeout=240)
    for index, case in enumerate(cases):
        ref_losses, ref_layers = _reference(
            case["m"], case.get("variable", False), case.get("forward_only", False)
        )
        seen = set()
        for rank in range(world_size):
            losses, grads, events = per_rank[rank][index]
            if case.get("sync"):
                _check_sync_hooks(case, rank, events)
                events = [e for e in events if e[0] in "FB"]
            if case.get("vp") and not case.get("forward_only"):  # what the planner reads
                order = interleaved_chunk_order(
                    case["m"], case["pp"], rank, case["vp"], case.get("group")
                )
                assert [(e[0] == "F", e[2]) for e in events] == order, (case, rank)
            assert events == _expected_order(case, rank), (case, rank)
            if rank == world_size - 1:
                for step in range(STEPS):
                    torch.testing.assert_close(
                        torch.stack(losses[step]), ref_losses[step], atol=1e-5, rtol=1e-5
                    )
            else:
                assert losses == [[]] * STEPS
            for i, (wg, bg, w, b) in grads.items():
                seen.add(i)
                ref = ref_layers[i]
                if case.get("forward_only"):
                    assert wg is None
                    continue
                for got, want in ((wg, ref.weight.grad), (bg, ref.bias.grad)):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                for got, want in ((w, ref.weight), (b, ref.bias)):
                    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
        assert seen == set(range(LAYERS)), case


# --- bad combinations: megatron-core's error types, raised before any p2p ---------------------


def _bad(cases):
    """Per-rank body: each case's (ValueError?, RuntimeError?, message), or None if it ran."""
    results = []
    for case in cases:
        try:
            _run(dict(case, pp=2))
            results.append(None)
        except Exception as error:  # noqa: BLE001 - the test inspects the type
            results.append(
                (isinstance(error, ValueError), isinstance(error, RuntimeError), str(error))
            )
        finally:
            parallel_state.destroy_model_parallel()
    return results


BAD = [
    # (case, megatron-core's type, message)
    (dict(vp=2, m=4, overlap=True, batch=True), ValueError, r"overlap_p2p_comm .* batch_p2p_comm"),
    (dict(m=4, overlap=True), ValueError, r"non-interleaved schedule"),
    (dict(vp=2, m=4, group=1), ValueError, r"group_size_per_vp_stage \(1\) must lie in \[pipe"),
    (dict(vp=2, m=4, group=5), ValueError, r"num_microbatches \(4\)\]"),
    (dict(vp=2, m=5, group=4), RuntimeError, r"num_microbatches \(5\) mod .* is 1"),
    (dict(vp=2, m=3), RuntimeError, r"num_microbatches \(3\) mod .* \(2\) is 1"),
]


def test_bad_combinations_raise_megatron_types_before_p2p():
    # Both ranks raise; a rank that reached a p2p call would wait for its peer until the timeout.
    import re

    for results in run_distributed(_bad, 2, [case for case, *_ in BAD], timeout=60):
        for (case, kind, message), result in zip(BAD, results):
            assert result is not None, case
            is_value_error, is_runtime_error, text = result
            assert is_value_error if kind is ValueError else is_runtime_error, (case, text)
            assert re.search(message, text), (case, text)


# --- megatron-core's pure functions and signatures ----------------------------------------------


def test_schedule_table_and_warmup_equal_megatron():
    pytest.importorskip("megatron.core", reason="the [megatron] extra (megatron-core)")
    from megatron.core.pipeline_parallel import schedules as mcore

    for m, vp, group in [(5, 2, 3), (8, 2, 4), (10, 2, 5), (6, 3, 2), (7, 2, 7), (4, 4, 4)]:
        assert schedules.get_schedule_table(m, vp, group) == mcore.get_schedule_table(m, vp, group)
    for pp, rank, vp, m, group, fwd_only, moe in [
        (4, 0, 2, 8, 4, False, False),
        (4, 3, 2, 10, 5, False, True),
        (2, 1, 3, 2, 2, False, False),
        (4, 1, None, 3, 4, False, False),
        (2, 0, 2, 4, 2, True, False),
    ]:
        fake = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(size=lambda pp=pp: pp, rank=lambda rank=rank: rank),
            virtual_pipeline_model_parallel_size=vp,
        )
        args = (m, vp or 1, group, fwd_only, moe, fake)
        assert schedules.get_pp_rank_microbatches(*args) == mcore.get_pp_rank_microbatches(*args)


def test_public_signatures_are_megatron_prefixes():
    # 0.16.1's parameters, in order, come first (later additions are keywords with defaults);
    # a newer megatron-core's are all accepted by keyword (docs/guides/newer-megatron-core.md).
    pytest.importorskip("megatron.core", reason="the [megatron] extra (megatron-core)")
    from megatron.core.pipeline_parallel import p2p_communication as mp2p
    from megatron.core.pipeline_parallel import schedules as mcore
    from megatron.core.pipeline_parallel import utils as mutils

    from megatron_core.pipeline_parallel import p2p_communication, utils

    pairs = [(schedules, mcore, n) for n in schedules.__all__ if hasattr(mcore, n)]
    pairs += [(utils, mutils, n) for n in utils.__all__]
    pairs += [(p2p_communication, mp2p, "is_single_shape")]
    assert len(pairs) >= 25
    for ours, theirs, name in pairs:
        if not inspect.isfunction(getattr(theirs, name)):
            continue
        want = list(inspect.signature(getattr(theirs, name)).parameters)
        got = list(inspect.signature(getattr(ours, name)).parameters)
        if megatron_core_version() == "0.16.1":
            assert got[: len(want)] == want, name
        else:
            assert set(want) <= set(got), name


def test_small_helpers_match_megatron():
    pytest.importorskip("megatron.core", reason="the [megatron] extra (megatron-core)")
    from megatron.core.pipeline_parallel import p2p_communication as mp2p
    from megatron.core.pipeline_parallel import utils as mutils

    from megatron_core.pipeline_parallel import p2p_communication, utils

    for shape in [torch.Size([2, 3]), [1, 2, 3], (4,), [], [[1, 2]], "abc", None]:
        assert p2p_communication.is_single_shape(shape) == mp2p.is_single_shape(shape)
    for stage, size in [(0, 2), (1, 2), (None, None), (0, 1), (2, 4), (3, 4)]:
        assert utils.is_vp_first_stage(stage, size) == mutils.is_vp_first_stage(stage, size)
        assert utils.is_vp_last_stage(stage, size) == mutils.is_vp_last_stage(stage, size)
    base = torch.randn(4, 3, requires_grad=True)
    view = (base * 2).view(3, 4)
    out = utils.make_viewless(view)
    assert out._base is None and torch.equal(out, view)
    out.sum().backward()
    torch.testing.assert_close(base.grad, torch.full((4, 3), 2.0))
    assert schedules.get_tensor_device({"a": base}) == base.device
    config = types.SimpleNamespace(sequence_parallel=True, hidden_size=8)
    groups = types.SimpleNamespace(size=lambda: 2)
    assert schedules.get_tensor_shapes(
        seq_length=16,
        micro_batch_size=3,
        decoder_seq_length=8,
        config=config,
        tp_group=groups,
        cp_group=groups,
    ) == [(2, 3, 8)]


def test_backward_step_takes_both_megatron_call_forms():
    # 0.16.1: (input, output, grad, model_type, config); 0.19: (input, output, grad, config)
    config = types.SimpleNamespace(grad_scale_func=None, deallocate_pipeline_outputs=False)
    for form_019 in (False, True):
        x = torch.randn(3, requires_grad=True)
        y = (x * 3).sum()
        if form_019:
            grad = schedules.backward_step(x, y, None, config)
        else:
            grad = schedules.backward_step(x, y, None, None, config)
        torch.testing.assert_close(grad, torch.full((3,), 3.0))
    x = torch.randn(2, requires_grad=True)
    grads = schedules.backward_step([x], [(x * 2).sum()], [None], None, config)
    assert isinstance(grads, list) and torch.equal(grads[0], torch.full((2,), 2.0))


def _stage_helpers():
    from megatron_core.pipeline_parallel import P2PCommunicator, utils

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    group = parallel_state.get_pipeline_model_parallel_group()
    p2p = P2PCommunicator(group, types.SimpleNamespace(virtual_pipeline_model_parallel_size=None))
    return (
        utils.is_pp_first_stage(group),
        utils.is_pp_last_stage(group),
        utils.get_pp_first_rank(group),
        utils.get_pp_last_rank(group),
        utils.get_pp_next_rank(group),
        utils.get_pp_prev_rank(group),
        (p2p.is_pp_first_stage, p2p.is_pp_last_stage, p2p.total_stages, p2p.current_stage),
    )


def test_stage_helpers_on_two_ranks():
    first, last = run_distributed(_stage_helpers, 2, timeout=60)
    assert first == (True, False, 0, 1, 1, None, (True, False, 2, 0))
    assert last == (False, True, 0, 1, None, 0, (False, True, 2, 1))
    func = get_forward_backward_func(2, None, schedule_pg_collection=None)
    assert func is schedules.forward_backward_pipelining_without_interleaving


def _pp4_errors():
    """1F1B and interleaved at pp=4 without pipeline_dtype: the message names pp=4."""
    messages = []
    for vp in (None, 2):
        try:
            _run(dict(pp=4, vp=vp, m=4, dtype_missing=True))
        except RuntimeError as error:
            messages.append(str(error))
        finally:
            parallel_state.destroy_model_parallel()
    return messages


def test_argument_error_names_the_real_pipeline_size():
    for messages in run_distributed(_pp4_errors, 4, timeout=60):
        assert len(messages) == 2
        for message in messages:
            assert "pipeline size (4)" in message, message


def test_backward_step_multimodule_per_module():
    # megatron-core 0.19: dicts by module name; a bare output is the language model's loss.
    config = types.SimpleNamespace(
        grad_scale_func=lambda x: 2 * x, deallocate_pipeline_outputs=False
    )
    vision, text = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    loss = (vision * 3).sum() + (text * 5).sum()
    grads = schedules.backward_step_multimodule(
        {"vision": vision, "lm": [text], "none": None}, loss, None, config, "lm"
    )
    assert grads["none"] is None
    torch.testing.assert_close(grads["vision"], torch.full((3,), 6.0))  # grad_scale_func: x2
    torch.testing.assert_close(grads["lm"], torch.full((2,), 10.0))
