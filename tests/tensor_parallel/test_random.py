"""RNG tracker, seeding, snapshots, audit and save/load (random.py, rng/state.py).

In-process tests run on every available device type (cpu always, cuda when present) with explicit
ranks; the multi-rank tests run on gloo ranks through megatron_core.testing. Draws are compared
bitwise (rtol=atol=0): the same generator state must give the same numbers, not close ones.
"""

import io
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import device
from megatron_core import parallel_state as ps
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import random as tp_random
from megatron_core.tensor_parallel.rng import state as rng_state
from megatron_core.testing import run_distributed

MP = "model-parallel-rng"
DP = "data-parallel-rng"
EP = "expert-parallel-rng"
SEED = 1234
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # bitwise: same generator state


def draw():
    return torch.rand(16, device=device.current_device())


def reference(seed, chunks=1):
    """What ``chunks`` draws of 16 from a generator freshly seeded with ``seed`` give.

    Drawn in the same chunks as the code under test: on cuda one draw of 32 is not two of 16.
    """
    gen = torch.Generator(device=device.current_device()).manual_seed(seed)
    dev = device.current_device()
    return torch.cat([torch.rand(16, generator=gen, device=dev) for _ in range(chunks)])


@pytest.fixture(params=DEVICES)
def dev(request):
    """Each test on each device type, with a fresh tracker; RNG states restored afterwards."""
    device.set_device_type(request.param)
    saved_cpu, saved_py = torch.get_rng_state(), random.getstate()
    saved_dev = device.get_rng_state()
    tp_random.initialize_rng_tracker(force_reset=True)
    yield request.param
    tp_random.initialize_rng_tracker(force_reset=True)
    device.set_rng_state(saved_dev)
    torch.set_rng_state(saved_cpu)
    random.setstate(saved_py)
    device.set_device_type(None)


def seeded(seed=SEED, **ranks):
    if not ps.model_parallel_is_initialized():
        ranks.setdefault("tp_rank", 0)  # no parallel_state (one process): the rank is explicit
    tp_random.model_parallel_cuda_manual_seed(seed, **ranks)
    return tp_random.get_cuda_rng_tracker()


# --- tracker ---------------------------------------------------------------------------------


def test_seeds_match_megatron_core(dev):
    tracker = seeded(tp_rank=1, ep_rank=2, etp_rank=1)
    assert tracker.is_initialized()
    assert tp_random.get_data_parallel_rng_tracker_name() == DP
    assert tp_random.get_expert_parallel_rng_tracker_name() == EP
    same(draw(), reference(SEED))  # the default stream
    for name, seed in ((DP, SEED), (MP, SEED + 2718 + 1), (EP, SEED + 1024 + 100 * 2 + 1)):
        with tracker.fork(name):
            same(draw(), reference(seed))


def test_cpu_generator_is_seeded_too(dev):
    torch.manual_seed(99)
    seeded()
    same(torch.rand(16), torch.rand(16, generator=torch.Generator().manual_seed(SEED)))


def test_tp_rank_is_required_without_parallel_state(dev):
    # Taking tp_rank 0 here would give every TP rank the same stream (megatron-core raises).
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(MegatronCoreError, match="called before initialize_model_parallel"):
        tp_random.model_parallel_cuda_manual_seed(SEED)
    ps.set_tensor_model_parallel_rank(1)  # megatron-core's override is honoured
    try:
        tp_random.model_parallel_cuda_manual_seed(SEED)
        tracker = tp_random.get_cuda_rng_tracker()
        with tracker.fork():
            same(draw(), reference(SEED + 2718 + 1))
    finally:
        ps.set_tensor_model_parallel_rank(None)


def test_expert_ranks_default_to_zero_without_parallel_state(dev):
    assert not ps.model_parallel_is_initialized()
    tracker = seeded()
    with tracker.fork():
        same(draw(), reference(SEED + 2718))
    with tracker.fork(EP):
        same(draw(), reference(SEED + 1024))


def test_add_and_fork_refuse_with_names(dev):
    tracker = seeded()
    with pytest.raises(MegatronCoreError, match=r"seed 1234 already exists.*'data-parallel-rng'"):
        tracker.add("other", SEED)
    with pytest.raises(MegatronCoreError, match=r"stream 'model-parallel-rng' exists"):
        tracker.add(MP, 7)
    with pytest.raises(MegatronCoreError, match=r"fork\('nope'\): stream 'nope' is not added"):
        with tracker.fork("nope"):
            pass
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}


def test_fork_leaves_default_untouched_also_on_error(dev):
    tracker = seeded()
    expected = reference(SEED, chunks=2)
    first = draw()
    with tracker.fork():
        inside = draw()
    with pytest.raises(ValueError):
        with tracker.fork():
            draw()
            raise ValueError("body failed")
    same(torch.cat([first, draw()]), expected)  # the default stream never saw the forks
    stream = reference(SEED + 2718, chunks=3)
    same(inside, stream[:16])
    with tracker.fork():  # the failed body's draws (16:32) were kept: the stream went on
        same(draw(), stream[32:])


def test_nested_forks_equal_sequential_forks(dev):
    def nested():
        tracker = seeded()
        out = []
        with tracker.fork(MP):
            out.append(draw())
            with tracker.fork(DP):
                out.append(draw())
                with tracker.fork(MP):
                    out.append(draw())
                out.append(draw())
            out.append(draw())
        out.append(draw())
        return out

    def sequential():
        tracker = seeded()
        out = []
        for name in (MP, DP, MP, DP, MP):
            with tracker.fork(name):
                out.append(draw())
        out.append(draw())
        return out

    for a, b in zip(nested(), sequential(), strict=True):
        same(a, b)


def test_states_are_values_not_aliases(dev):
    tracker = seeded()
    held = tracker.get_states()
    copies = {k: v.clone() for k, v in held.items()}
    with tracker.fork():
        draw()
    for name in held:  # get_states returns copies: a fork never writes into them
        same(held[name], copies[name])


def test_set_states_keeps_the_dict_as_given(dev):
    """megatron-core semantics: the dict itself is kept, any values, and forks write into it."""
    tracker = tp_random.CudaRNGStatesTracker()
    given = {"state1": 1234}
    tracker.set_states(given)
    assert tracker.states_ is given and tracker.get_states() == {"state1": 1234}
    held = seeded().get_states()
    tracker.set_states(held)
    before = held[MP]
    with tracker.fork():
        first = draw()
    assert held[MP] is not before  # the advanced state was stored into the caller's dict
    with tracker.fork():
        assert not torch.equal(draw(), first)  # continues from there
    tracker.set_states({k: v.clone() for k, v in held.items()})
    with tracker.fork():  # a copy replays the stream from the same point twice
        same(draw(), draw_after(held[MP]))


def draw_after(state):
    gen = device.device_generator()
    saved = gen.get_state()
    gen.set_state(state)
    try:
        return draw()
    finally:
        gen.set_state(saved)


def test_snapshot_is_reusable_and_immutable(dev):
    tracker = seeded()
    random.seed(5)
    snapshot = tp_random.get_rng_snapshot()
    held = {k: v.clone() for k, v in snapshot.tracker_states.items()}
    cpu, dev_state = snapshot.cpu_state.clone(), snapshot.device_state.clone()
    runs = []
    for _ in range(2):
        tp_random.set_rng_snapshot(snapshot)
        with tracker.fork():
            inside = draw()
        runs.append((draw(), inside, torch.rand(4)))
    for a, b in zip(*runs, strict=True):
        same(a, b)
    same(snapshot.cpu_state, cpu)
    same(snapshot.device_state, dev_state)
    for name, state in snapshot.tracker_states.items():
        same(state, held[name])
    with pytest.raises(TypeError):
        snapshot.tracker_states[MP] = held[MP]  # read-only mapping
    # On cpu the device stream is kept apart once seeded (NOTE [ RNG streams ], rule 6), so
    # the snapshot holds it beside the CPU generator's state, as on cuda.
    assert snapshot.device_state is not snapshot.cpu_state


def test_one_cpu_generator_is_stored_once_before_seeding(dev):
    snapshot = tp_random.get_rng_snapshot()
    if dev == "cpu":  # not seeded: one generator serves both, stored once and restored once
        assert snapshot.device_state is snapshot.cpu_state


def device_draw():
    with tp_random.device_rng():
        return draw()


def test_device_stream_is_apart_from_host_draws(dev):
    # NOTE [ RNG streams ], rule 6: host draws never move the device stream (on cuda they are
    # another generator; on cpu the stream is kept apart from the CPU generator).
    tracker = seeded()
    first = device_draw()
    seeded()
    torch.rand(7)  # a host draw, e.g. a data loader's seed on TP rank 0 only
    same(device_draw(), first)
    snapshot = tp_random.get_rng_snapshot()  # replays both
    device_next, host_next = device_draw(), torch.rand(3)
    tp_random.set_rng_snapshot(snapshot)
    same(device_draw(), device_next)
    same(torch.rand(3), host_next)
    state = tp_random.get_device_rng_state()
    again = device_draw()
    tp_random.set_device_rng_state(state)
    same(device_draw(), again)
    tp_random.device_manual_seed(5)
    same(device_draw(), reference(5))
    with tracker.fork():  # inside a fork the forked stream serves device draws
        same(device_draw(), reference(SEED + 2718))
    own = tp_random.CudaRNGStatesTracker()  # so does a fork of a tracker of the user's own
    own.add("mine", 77)
    with own.fork("mine"):
        same(device_draw(), reference(77))
    # A checkpoint's recompute replays the dropout mask although the host drew in between.
    x = torch.ones(64, device=device.current_device(), requires_grad=True)
    out = tp_random.checkpoint(_device_dropout, False, x)
    torch.rand(5)
    out.sum().backward()
    same(x.grad, out.detach())  # x is ones: the gradient is the forward's mask times 2


def _device_dropout(t):
    with tp_random.device_rng():
        return F.dropout(t, 0.5)


def test_snapshot_inside_fork_replays_the_in_flight_stream(dev):
    tracker = seeded()
    with tracker.fork():
        draw()
        snapshot = tp_random.get_rng_snapshot()
        runs = []
        for _ in range(2):
            tp_random.set_rng_snapshot(snapshot)
            first = draw()
            with tracker.fork():  # a nested fork of the active stream continues it
                second = draw()
            runs.append(torch.cat([first, second, draw()]))
    same(runs[0], runs[1])
    same(runs[0], reference(SEED + 2718, chunks=4)[16:])


def test_inference_tracker_fork_is_a_no_op(dev):
    tp_random.model_parallel_cuda_manual_seed(
        SEED, inference_rng_tracker=True, force_reset_rng=True, tp_rank=0
    )
    tracker = tp_random.get_cuda_rng_tracker()
    assert isinstance(tracker, tp_random.InferenceCudaRNGStatesTracker)
    with tracker.fork():
        inside = draw()
    same(torch.cat([inside, draw()]), reference(SEED, chunks=2))
    assert tracker.get_states() == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_cuda_only_modes_refuse_on_cpu(dev):
    with pytest.raises(MegatronCoreError, match="use_cudagraphable_rng=True needs an accelerator"):
        tp_random.model_parallel_cuda_manual_seed(
            1, use_cudagraphable_rng=True, force_reset_rng=True, tp_rank=0
        )
    with pytest.raises(MegatronCoreError, match="te_rng_tracker=True needs Transformer Engine"):
        tp_random.model_parallel_cuda_manual_seed(
            1, te_rng_tracker=True, force_reset_rng=True, tp_rank=0
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph-safe streams need a GPU")
def test_graph_safe_streams_on_cuda():
    device.set_device_type("cuda")
    try:
        tp_random.model_parallel_cuda_manual_seed(
            SEED, use_cudagraphable_rng=True, force_reset_rng=True, tp_rank=0
        )
        tracker = tp_random.get_cuda_rng_tracker()
        snapshot = tp_random.get_rng_snapshot()
        runs = []
        for _ in range(2):
            tp_random.set_rng_snapshot(snapshot)
            with tracker.fork():
                runs.append(torch.cat([draw(), draw()]))
        same(runs[0], runs[1])
        same(runs[0], reference(SEED + 2718, chunks=2))
    finally:
        tp_random.initialize_rng_tracker(force_reset=True)
        device.set_device_type(None)


# --- save / load (in-process) ----------------------------------------------------------------


def _round_trip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _draw_everything(tracker):
    with tracker.fork():
        inside = draw()
    with tracker.fork(EP):
        expert = draw()
    return [draw(), inside, expert, torch.rand(4), torch.tensor([random.random()])]


def test_save_draw_load_draw_is_identical(dev):
    tracker = seeded()
    _draw_everything(tracker)
    saved = _round_trip(rng_state.get_rng_state_dict())
    first = _draw_everything(tracker)
    rng_state.set_rng_state_dict(saved)
    for a, b in zip(first, _draw_everything(tracker), strict=True):
        same(a, b)


def test_load_refuses_another_layout_and_version(dev):
    seeded()
    saved = rng_state.get_rng_state_dict()
    assert saved["layout"]["global_rank"] == 0 and saved["layout"]["tp_rank"] is None
    saved["layout"]["global_rank"] = 3
    saved["layout"]["world_size"] = 4
    with pytest.raises(MegatronCoreError, match=r"world_size \(saved 4, now 1\), global_rank"):
        rng_state.set_rng_state_dict(saved)
    with pytest.raises(MegatronCoreError, match=r"version \(None\)"):
        rng_state.set_rng_state_dict({})


# --- multi-rank --------------------------------------------------------------------------------

# world size -> (tp, ep) configs; dp = world / tp. Covers world 1/2/4 and tp2 x dp2.
CONFIGS = {1: [(1, 1)], 2: [(2, 1), (1, 1)], 4: [(2, 1), (4, 1), (1, 2), (2, 2)]}


def _body_masks(configs):
    out = []
    for tp, ep in configs:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        tracker = seeded()
        ones = torch.ones(256, device=device.current_device())  # the tracker's streams' device
        with tracker.fork():
            inside = F.dropout(ones, 0.5).cpu()
        with tracker.fork(EP):
            expert = F.dropout(ones, 0.5).cpu()
        outside = F.dropout(ones, 0.5).cpu()
        before = tp_random.get_rng_snapshot()
        report = rng_state.audit_rng_streams()
        after = tp_random.get_rng_snapshot()
        untouched = torch.equal(before.cpu_state, after.cpu_state) and all(
            torch.equal(before.tracker_states[k], after.tracker_states[k])
            for k in before.tracker_states
        )
        coords = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank())
        coords += (ps.get_expert_model_parallel_rank(),)
        out.append((coords, inside, outside, expert, report, untouched))
        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_dropout_masks_across_ranks_and_audit(world_size):
    per_rank = run_distributed(_body_masks, world_size, CONFIGS[world_size], timeout=120)
    for i in range(len(CONFIGS[world_size])):
        seen = [results[i] for results in per_rank]
        for coords, inside, outside, expert, report, untouched in seen:
            assert report.ok and not report.violations and len(report.passed) == 6
            assert untouched, "the audit changed an RNG state"
            for coords2, inside2, outside2, expert2, _, _ in seen:
                same(outside, outside2)  # replicated activations: one mask everywhere
                if coords2[0] == coords[0]:  # same TP shard (DP replicas): same mask inside
                    same(inside, inside2)
                else:
                    assert not torch.equal(inside, inside2)
                # expert stream: tp/ep shards differ
                assert torch.equal(expert, expert2) == (
                    coords2[0] == coords[0] and coords2[2] == coords[2]
                )


def _body_wrong_seeding(mistake):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    if mistake == "same tp rank":
        tp_random.model_parallel_cuda_manual_seed(SEED, tp_rank=0)
    elif mistake == "seed per rank":
        tp_random.model_parallel_cuda_manual_seed(SEED + rank)
    elif mistake == "dp replicas differ":
        tp_random.model_parallel_cuda_manual_seed(SEED, tp_rank=rank)
    else:
        tp_random.initialize_rng_tracker(force_reset=True)  # never seeded
    try:
        rng_state.audit_rng_streams()
    except MegatronCoreError as e:
        report = rng_state.audit_rng_streams(raise_on_violation=False)
        return str(e), report
    return "NO ERROR", None


@pytest.mark.parametrize(
    "mistake, expected",
    [
        ("same tp rank", "'model-parallel-rng' must be DISTINCT across the tp group"),
        ("seed per rank", "'data-parallel-rng' must be EQUAL across the tp group"),
        ("dp replicas differ", "'model-parallel-rng' must be EQUAL across the dp group"),
        ("never seeded", "have no 'model-parallel-rng' stream"),
    ],
)
def test_audit_catches_wrong_seeding_on_every_rank(mistake, expected):
    per_rank = run_distributed(_body_wrong_seeding, 4, mistake, timeout=120)
    for message, report in per_rank:
        assert message.startswith("RNG stream audit failed")
        assert report.total_violations > 0 and not report.ok
    assert any(expected in message for message, _ in per_rank), per_rank


def _body_save_load():
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tracker = seeded()
    random.seed(dist.get_rank())
    mine = _round_trip(rng_state.get_rng_state_dict())
    first = _draw_everything(tracker)
    rng_state.set_rng_state_dict(mine)
    second = _draw_everything(tracker)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    other = everyone[(dist.get_rank() + 1) % dist.get_world_size()]
    before = rng_state.get_rng_state_dict()
    try:
        rng_state.set_rng_state_dict(other)
        refused = "NO ERROR"
    except MegatronCoreError as e:
        refused = str(e)
    after = rng_state.get_rng_state_dict()  # the refused load restored nothing
    untouched = before["python"] == after["python"] and all(
        torch.equal(before[k], after[k]) for k in ("cpu", "device")
    )
    untouched &= all(torch.equal(v, after["tracker"][k]) for k, v in before["tracker"].items())
    rng_state.audit_rng_streams()  # callable after loading
    return first, second, untouched, refused


def test_save_load_per_rank_and_refusal_of_another_ranks_state():
    per_rank = run_distributed(_body_save_load, 4, timeout=120)
    for rank, (first, second, untouched, refused) in enumerate(per_rank):
        for a, b in zip(first, second, strict=True):
            same(a, b)
        assert untouched
        assert f"global_rank (saved {(rank + 1) % 4}, now {rank})" in refused
        assert "tp_rank (saved" in refused


def test_checkpoint_is_re_exported_from_random():
    from megatron_core.tensor_parallel.recompute import entry_points as checkpointing

    assert tp_random.checkpoint is checkpointing.checkpoint  # megatron-core's import path


def test_set_states_marks_the_tracker_initialized(dev):
    held = seeded().get_states()
    tracker = tp_random.CudaRNGStatesTracker()
    assert not tracker.is_initialized()
    tracker.set_states(held)
    assert tracker.is_initialized()
    with tracker.fork():
        same(draw(), reference(SEED + 2718))


def test_audit_needs_parallel_state(dev):
    seeded()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(MegatronCoreError, match="audit_rng_streams needs parallel_state"):
        rng_state.audit_rng_streams()


def _body_audit_inside_fork():
    ps.initialize_model_parallel()
    tracker = seeded()
    with tracker.fork(DP):
        try:
            rng_state.audit_rng_streams()
            return "NO ERROR"
        except MegatronCoreError as e:
            return str(e)


def test_audit_inside_a_fork_is_refused_naming_the_stream():
    (message,) = run_distributed(_body_audit_inside_fork, 1, timeout=60)
    assert "audit_rng_streams called inside fork('data-parallel-rng')" in message


def test_have_te_is_megatron_cores_module_name(tmp_path, monkeypatch):
    # megatron-core 0.19's unit tests import HAVE_TE from tensor_parallel.random; it answers at
    # each read whether a regular transformer_engine module is importable (a namespace package of
    # that name, such as a folder of tests named so on pytest's path, is not one).
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)  # one imported by an earlier test
    (tmp_path / "namespace" / "transformer_engine").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "namespace"), *sys.path])
    assert tp_random.HAVE_TE is False
    package = tmp_path / "regular" / "transformer_engine"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "regular"), *sys.path])
    from megatron_core.tensor_parallel.random import HAVE_TE

    assert HAVE_TE is True
