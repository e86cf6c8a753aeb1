"""Ranks that disagree raise the same clear error on every rank, within seconds.

Each case below is one way users make the ranks of a tensor-parallel group disagree (an
off-by-one batch on one rank, a vocabulary split computed locally, ...). Before the consistency
checks these hung, aborted the process inside gloo, or returned wrong numbers. Every case runs at
TP = 2 and 4 (world size = TP) in check mode; the ALWAYS cases also without it. Passing means:
every rank raised a MegatronCoreError, all with the same message, which names the op, the group
and each rank's value, in under 10 s; no worker died (the harness would report it).

The per-rank body catches what the case raises and returns it, so one warm worker pool serves
every case. Groups get a short timeout (_GROUP_TIMEOUT_MIN): a case the checks missed would end
in a CollectiveError after 6 s instead of hanging, and fail the assertions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from megatron_core import consistency, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron_core.tensor_parallel.data import broadcast_data
from megatron_core.tensor_parallel.mappings import all_to_all
from megatron_core.tensor_parallel.utils import gather_split_1d_tensor
from megatron_core.testing import run_distributed, shutdown_pools

_GROUP_TIMEOUT_MIN = 0.1  # 6 s: a missed case times out (and fails) instead of hanging
_LIMIT_S = 10.0


def _init(tp: int, **kwargs) -> dist.ProcessGroup:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, distributed_timeout_minutes=_GROUP_TIMEOUT_MIN, **kwargs
    )
    return parallel_state.get_tensor_model_parallel_group()


def _last() -> bool:
    """True on the one rank that disagrees (the last)."""
    return dist.get_rank() == dist.get_world_size() - 1


# --- the cases (each runs on every rank; world size = tp) --------------------------------------


def _reduce_4_vs_3(tp):
    _init(tp)
    return reduce_from_tensor_model_parallel_region(torch.ones(3 if _last() else 4))


def _reduce_3_vs_4(tp):
    _init(tp)
    return reduce_from_tensor_model_parallel_region(torch.ones(4 if _last() else 3))


def _reduce_f32_vs_f64(tp):
    _init(tp)
    return reduce_from_tensor_model_parallel_region(
        torch.ones(3, dtype=torch.float64 if _last() else torch.float32)
    )


def _gather_last_dim_3_vs_5(tp):
    _init(tp)
    return gather_from_tensor_model_parallel_region(torch.ones(4, 5 if _last() else 3))


def _gather_first_dim_4_vs_2(tp):
    _init(tp)
    return gather_from_tensor_model_parallel_region(torch.ones(2 if _last() else 4, 3))


def _gather_4x3_vs_3x4(tp):
    _init(tp)
    return gather_from_tensor_model_parallel_region(torch.ones((3, 4) if _last() else (4, 3)))


def _gather_ndim_2_vs_3(tp):
    _init(tp)  # the same number of elements: gloo would mix the bytes silently
    return gather_from_tensor_model_parallel_region(torch.ones((4, 3, 1) if _last() else (4, 3)))


def _gather_f32_vs_f64(tp):
    _init(tp)
    x = torch.ones(4, 3, dtype=torch.float64 if _last() else torch.float32)
    return gather_from_tensor_model_parallel_region(x)


def _sequence_gather_4_vs_2(tp):
    _init(tp)
    return gather_from_sequence_parallel_region(torch.ones(2 if _last() else 4, 2))


def _sequence_reduce_scatter_shape(tp):
    _init(tp)
    return reduce_scatter_to_sequence_parallel_region(torch.ones(4 * tp, 3 if _last() else 2))


def _uneven_gather_split_sizes(tp):
    _init(tp)  # the last rank holds one row more than output_split_sizes says
    rows = [1] * tp
    return gather_from_sequence_parallel_region(
        torch.ones(2 if _last() else 1, 3), output_split_sizes=rows
    )


def _all_to_all_split_sizes(tp):
    group = _init(tp)  # rank 0 sends 2 rows to the last rank, which expects 1
    out_sizes = [1] * tp
    in_sizes = [1] * tp
    if dist.get_rank() == 0:
        in_sizes = [0] * (tp - 1) + [2]
    return all_to_all(group, torch.ones(sum(in_sizes), 2), out_sizes, in_sizes)


def _split_1d_chunks_3_vs_5(tp):
    group = _init(tp)
    return gather_split_1d_tensor(torch.ones(5 if _last() else 3), group=group)


def _split_1d_numel_6_vs_5(tp):
    group = _init(tp)  # both numels give chunks of the same size: the outputs would differ
    numel = 5 if _last() else 6
    chunk = -(-numel // tp)
    return gather_split_1d_tensor(torch.ones(chunk), group=group, numel=numel)


def _logits(rows, partition):
    return torch.randn(rows, partition, generator=torch.Generator().manual_seed(0))


def _ce_target_out_of_range_one_rank(tp):
    _init(tp)
    target = torch.tensor([0, 1, 4 * tp + 3 if _last() else 2])
    return vocab_parallel_cross_entropy(_logits(3, 4), target)


def _ce_batch_3_vs_5(tp):
    _init(tp)
    rows = 5 if _last() else 3
    return vocab_parallel_cross_entropy(_logits(rows, 4), torch.zeros(rows, dtype=torch.long))


def _ce_batch_2x3_vs_3x2(tp):
    _init(tp)  # as many tokens on every rank, cut into other shapes
    shape = (3, 2) if _last() else (2, 3)
    logits = torch.randn(*shape, 4, generator=torch.Generator().manual_seed(0))
    return vocab_parallel_cross_entropy(logits, torch.zeros(shape, dtype=torch.long))


def _ce_vocab_4_vs_6(tp):
    _init(tp)
    return vocab_parallel_cross_entropy(_logits(3, 6 if _last() else 4), torch.tensor([0, 1, 2]))


def _ce_targets_differ(tp):
    _init(tp)
    target = torch.tensor([0, 1, 3 if _last() else 2])
    return vocab_parallel_cross_entropy(_logits(3, 4), target)


def _broadcast_datatype(tp, source_dtype, other_dtype):
    _init(tp)
    data = {"a": torch.arange(3, dtype=source_dtype)} if dist.get_rank() == 0 else None
    return broadcast_data(["a"], data, source_dtype if dist.get_rank() == 0 else other_dtype)


def _broadcast_f32_vs_i64(tp):
    return _broadcast_datatype(tp, torch.float32, torch.int64)


def _broadcast_i64_vs_f64(tp):
    return _broadcast_datatype(tp, torch.int64, torch.float64)


def _broadcast_keys(tp):
    _init(tp)
    data = {"a": torch.ones(2), "b": torch.ones(3)} if dist.get_rank() == 0 else None
    return broadcast_data(["a"] if _last() else ["a", "b"], data, torch.float32)


def _embedding_out_of_range(tp):
    from megatron_core.model_parallel_config import ModelParallelConfig
    from megatron_core.tensor_parallel import (
        VocabParallelEmbedding,
        model_parallel_cuda_manual_seed,
    )

    _init(tp)
    model_parallel_cuda_manual_seed(1)
    config = ModelParallelConfig(tensor_model_parallel_size=tp)
    layer = VocabParallelEmbedding(4 * tp, 3, init_method=torch.nn.init.normal_, config=config)
    return layer(torch.tensor([[0, 4 * tp + 1, -1]]))


def _embedding_after_the_window(tp):
    consistency.set_window(0)  # the default window is closed: the local range check is left
    try:
        return _embedding_out_of_range(tp)
    finally:
        consistency.set_window(None)


def _checkpoint_input_differs(tp):
    from megatron_core.tensor_parallel import checkpoint

    _init(tp)
    linear = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4 * tp)
    if _last():
        x[1, 2] = 2.0  # the recompute would use the other ranks' chunks of their own input
    out = checkpoint(lambda t: linear(t.view(-1, 4)), True, x.requires_grad_())
    out.sum().backward()
    return out


def _checkpoint_backward_one_rank(tp):
    from megatron_core.tensor_parallel import checkpoint

    _init(tp)
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4 * tp, requires_grad=True)
    out = checkpoint(lambda t: linear(t.view(-1, 4)), True, x)
    if dist.get_rank() == 0:
        out.sum().backward()  # gathers the distributed input: a collective
    else:  # the others skip backward and go on to the next step's first collective
        reduce_from_tensor_model_parallel_region(torch.ones(2))


def _init_tp_fresh(tp):
    # Run in fresh worker processes (Case.fresh): no group is cached yet; the ranks used to hang
    # in new_group here.
    _init(1 if _last() else tp)


def _init_tp_cached(tp):
    for size in (tp, 1):  # both layouts' groups are now in the group cache
        _init(size)
        parallel_state.destroy_model_parallel()
    _init(1 if _last() else tp)  # used to be accepted: sizes [tp, 1], then a hang


def _init_invalid_on_one_rank(tp):
    # The last rank asks for a size that does not divide the world: it fails validation alone,
    # and its peers must not wait for it in the argument agreement.
    _init(3 if _last() else tp)


def _modes_differ(tp):
    # One rank in another consistency mode would stop checking at another collective than its
    # peers: initialize_model_parallel's agreement (always on) names it first.
    if _last():
        consistency.set_mode("always" if consistency.mode().value != "always" else "window")
    _init(tp)


def _finalize_grads_of_different_models(tp):
    # Data-parallel replicas whose models differ (one rank built a wider layer): the flat
    # gradient buffers differ in size; gloo would abort or mix the bytes.
    from megatron_core.distributed import finalize_model_grads

    parallel_state.initialize_model_parallel()  # tp = 1: every rank is a data-parallel replica
    model = torch.nn.Linear(3, 4 if _last() else 3)
    model(torch.ones(2, 3)).sum().backward()
    finalize_model_grads([model])


def _seed_before_initialize(tp):
    from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)  # used to take tp_rank 0 on every rank


def _reentrant_checkpoint_no_grad_inputs(tp):
    import warnings

    from megatron_core.tensor_parallel import checkpoint

    _init(tp)
    linear = torch.nn.Linear(3, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = checkpoint(linear, False, torch.ones(2, 3))  # no input requires grad
    (out.sum() + linear.bias.sum()).backward()  # the loss also uses the bias directly
    assert linear.weight.grad is None  # what the warning is about: no gradient inside
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    raise MegatronCoreError(f"warned: {messages}")  # reported like the other cases


@dataclasses.dataclass(frozen=True)
class Case:
    body: Callable[[int], object]
    fragments: tuple[str, ...]  # the message names these (the op and the values)
    always: bool = False  # also raises outside check mode
    unchecked_fragments: tuple[str, ...] | None = None  # outside check mode, if they differ
    local: bool = False  # raised (or warned) by each rank alone: no group to name
    fresh: bool = False  # needs fresh worker processes (nothing in the group cache)


CASES = {
    "init_tp_fresh": Case(
        _init_tp_fresh,
        ("initialize_model_parallel", "tensor_model_parallel_size", "= 1", "WORLD"),
        always=True,
        fresh=True,
    ),
    "init_tp_cached": Case(
        _init_tp_cached,
        ("initialize_model_parallel", "tensor_model_parallel_size", "= 1", "WORLD"),
        always=True,
    ),
    "init_invalid_on_one_rank": Case(
        _init_invalid_on_one_rank,
        ("initialize_model_parallel", "tensor_model_parallel_size", "= 3", "WORLD", "invalid"),
        always=True,
    ),
    "modes_differ": Case(
        _modes_differ,
        ("initialize_model_parallel", "consistency mode", "always, window 4096"),
        always=True,
    ),
    "finalize_grads_of_different_models": Case(
        _finalize_grads_of_different_models, ("finalize_model_grads all_reduce", "shape")
    ),
    "seed_before_initialize": Case(
        _seed_before_initialize,
        ("model_parallel_cuda_manual_seed", "before initialize_model_parallel", "tp_rank="),
        always=True,
        local=True,
    ),
    "reentrant_checkpoint_no_grad_inputs": Case(
        _reentrant_checkpoint_no_grad_inputs,
        ("warned: ['None of the inputs have requires_grad=True. Gradients will be None",),
        always=True,
        local=True,
    ),
    "reduce_4_vs_3": Case(_reduce_4_vs_3, ("all_reduce", "shape", "(4,)", "(3,)")),
    "reduce_3_vs_4": Case(_reduce_3_vs_4, ("all_reduce", "shape", "(3,)", "(4,)")),
    "reduce_f32_vs_f64": Case(_reduce_f32_vs_f64, ("all_reduce", "dtype", "torch.float64")),
    "gather_last_dim_3_vs_5": Case(
        _gather_last_dim_3_vs_5, ("gather along the last dimension", "(4, 3)", "(4, 5)")
    ),
    "gather_first_dim_4_vs_2": Case(
        _gather_first_dim_4_vs_2, ("gather along the last dimension", "(4, 3)", "(2, 3)")
    ),
    "gather_4x3_vs_3x4": Case(_gather_4x3_vs_3x4, ("shape", "(4, 3)", "(3, 4)")),
    "gather_ndim_2_vs_3": Case(_gather_ndim_2_vs_3, ("shape", "(4, 3)", "(4, 3, 1)")),
    "gather_f32_vs_f64": Case(_gather_f32_vs_f64, ("dtype", "torch.float32", "torch.float64")),
    "sequence_gather_4_vs_2": Case(_sequence_gather_4_vs_2, ("all_gather", "(4, 2)", "(2, 2)")),
    "sequence_reduce_scatter_shape": Case(
        _sequence_reduce_scatter_shape, ("reduce_scatter", "shape", ", 2)", ", 3)")
    ),
    "uneven_gather_split_sizes": Case(
        _uneven_gather_split_sizes,
        ("gather along the first dimension", "must equal this rank's first dimension (2)"),
        always=True,
    ),
    "all_to_all_split_sizes": Case(
        _all_to_all_split_sizes,
        ("all_to_all", "split sizes do not match", "sends 2 rows to rank", "which expects 1"),
        always=True,
    ),
    "split_1d_chunks_3_vs_5": Case(
        _split_1d_chunks_3_vs_5, ("gather_split_1d_tensor", "(3,)", "(5,)")
    ),
    "split_1d_numel_6_vs_5": Case(
        _split_1d_numel_6_vs_5, ("gather_split_1d_tensor", "numel", "= 6", "= 5")
    ),
    "ce_target_out_of_range_one_rank": Case(
        _ce_target_out_of_range_one_rank,
        ("vocab_parallel_cross_entropy", "content checksum"),  # the targets differ: caught first
        always=True,
        unchecked_fragments=("vocab_parallel_cross_entropy", "failed on 1 of the", "outside [0"),
    ),
    # cross entropy's always-on target exchange also compares the logits' shape
    "ce_batch_3_vs_5": Case(
        _ce_batch_3_vs_5, ("vocab_parallel_cross_entropy", "(3, 4)", "(5, 4)"), always=True
    ),
    "ce_batch_2x3_vs_3x2": Case(
        _ce_batch_2x3_vs_3x2,
        ("vocab_parallel_cross_entropy", "(2, 3, 4)", "(3, 2, 4)"),
        always=True,
    ),
    "ce_vocab_4_vs_6": Case(
        _ce_vocab_4_vs_6, ("vocab_parallel_cross_entropy", "(3, 4)", "(3, 6)"), always=True
    ),
    "ce_targets_differ": Case(
        _ce_targets_differ, ("vocab_parallel_cross_entropy", "content checksum")
    ),
    # broadcast_data's header exchange (always) carries a hash of the keys and the datatype
    "broadcast_f32_vs_i64": Case(
        _broadcast_f32_vs_i64,
        ("broadcast_data", "datatype", "torch.float32", "torch.int64"),
        always=True,
    ),
    "broadcast_i64_vs_f64": Case(
        _broadcast_i64_vs_f64,
        ("broadcast_data", "datatype", "torch.int64", "torch.float64"),
        always=True,
    ),
    "broadcast_keys": Case(_broadcast_keys, ("broadcast_data", "keys", "['a', 'b']", "['a']")),
    "embedding_out_of_range": Case(
        _embedding_out_of_range, ("VocabParallelEmbedding", "ids [", "outside [0, vocabulary size")
    ),
    "embedding_after_the_window": Case(
        _embedding_after_the_window,
        ("VocabParallelEmbedding", "ids [", "outside [0, vocabulary size"),
        local=True,  # each rank's own check, the same ids: the same error, no group involved
    ),
    "checkpoint_input_differs": Case(
        _checkpoint_input_differs,
        ("checkpoint(distribute_saved_activations=True) input #0", "content checksum"),
    ),
    "checkpoint_backward_one_rank": Case(
        _checkpoint_backward_one_rank, ("disagree on op", "gather_split_1d_tensor", "all_reduce")
    ),
}


# --- the harness -------------------------------------------------------------------------------


def _run_case(name: str, tp: int, check: bool | str):
    """``check``: True (check mode), False (every check off) or "window" (the default mode,
    forced here because tests/conftest.py turns check mode on for the suite)."""
    with consistency.check_mode(check):
        start = time.monotonic()
        try:
            expected = {True: "always", False: "off"}.get(check, check)
            if consistency.mode().value != expected:  # fails the test: not a package error
                raise AssertionError(f"mode {consistency.mode()} in force, not {expected}")
            value = CASES[name].body(tp)
        except consistency.CollectiveError:
            raise  # a timeout: the group is broken, so the harness must discard these workers
        except Exception as exc:
            return (
                "error",
                type(exc).__name__,
                isinstance(exc, MegatronCoreError),
                str(exc),
                (time.monotonic() - start),
            )
        return "returned", type(value).__name__, False, repr(value), time.monotonic() - start


def _assert_agreed_error(name: str, tp: int, check: bool | str) -> str:
    if CASES[name].fresh:
        shutdown_pools()  # the next call starts new worker processes
    results = run_distributed(_run_case, tp, name, tp, check, timeout=60)
    for rank, (outcome, type_name, is_package_error, message, seconds) in enumerate(results):
        assert outcome == "error", f"rank {rank} returned {type_name}: {message}"
        assert is_package_error, (
            f"rank {rank} raised {type_name}, not a MegatronCoreError: {message}"
        )
        assert seconds < _LIMIT_S, f"rank {rank} took {seconds:.1f} s"
    messages = {message for *_, message, _ in results}
    assert len(messages) == 1, f"the ranks raised different errors: {messages}"
    message = messages.pop()
    case = CASES[name]
    if not case.local:
        assert f"global ranks {list(range(tp))}" in message, message  # the group is named
    unchecked = check is False
    fragments = (case.unchecked_fragments or case.fragments) if unchecked else case.fragments
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_case_in_check_mode(name, tp):
    _assert_agreed_error(name, tp, check=True)


# The default mode (no switch turned on, NOTE [ Check window ]) must end these as check mode
# does. Gloo
# aborted the process in the first 7, the next 9 returned wrong results, the last 3 hung.
DEFAULT_MODE_CASES = {
    "abort": (
        "gather_first_dim_4_vs_2",
        "gather_last_dim_3_vs_5",
        "sequence_gather_4_vs_2",
        "split_1d_chunks_3_vs_5",
        "ce_batch_3_vs_5",
        "broadcast_f32_vs_i64",
        "broadcast_keys",
    ),
    "silent": (
        "gather_4x3_vs_3x4",
        "gather_ndim_2_vs_3",
        "gather_f32_vs_f64",
        "ce_vocab_4_vs_6",
        "ce_batch_2x3_vs_3x2",
        "broadcast_i64_vs_f64",
        "split_1d_numel_6_vs_5",
        "embedding_out_of_range",
        "checkpoint_input_differs",
    ),
    "hang": ("reduce_3_vs_4", "reduce_4_vs_3", "checkpoint_backward_one_rank"),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_case_in_the_default_mode(name, tp):
    """Every case, the check window's included, ends in the default mode as in check mode."""
    _assert_agreed_error(name, tp, check="window")


def test_issue_22_cases_are_all_run():
    listed = [n for names in DEFAULT_MODE_CASES.values() for n in names]
    assert len(listed) == 19 and set(listed) <= set(CASES)


@pytest.mark.parametrize("tp", [1, 2])
def test_out_of_vocabulary_ids_raise_after_the_window(tp):
    # The same ids on every rank, so each rank's own check raises the same error (no exchange).
    _assert_agreed_error("embedding_after_the_window", tp, check="window")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if case.always))
def test_always_on_case_without_check_mode(name, tp):
    _assert_agreed_error(name, tp, check=False)


def _good_inputs(tp: int, check: bool):
    """The same calls with agreeing inputs: no error, in or out of check mode."""
    with consistency.check_mode(check):
        group = _init(tp)
        out = [reduce_from_tensor_model_parallel_region(torch.ones(3))]
        out.append(gather_from_tensor_model_parallel_region(torch.ones(2, 3)))
        out.append(vocab_parallel_cross_entropy(_logits(3, 4), torch.tensor([0, 1, 4 * tp - 1])))
        out.append(all_to_all(group, torch.ones(tp, 2), [1] * tp, [1] * tp))
        out.append(gather_split_1d_tensor(torch.ones(3), group=group))
        data = {"a": torch.arange(3)} if dist.get_rank() == 0 else None
        out.append(broadcast_data(["a"], data, torch.int64)["a"])
        return [tuple(t.shape) for t in out]


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_agreeing_ranks_pass(tp, check):
    results = run_distributed(_good_inputs, tp, tp, check, timeout=60)
    assert results == [[(3,), (2, 3 * tp), (3,), (tp, 2), (3 * tp,), (3,)]] * tp


# --- a dead peer -----------------------------------------------------------------------------


def _dead_peer(tp):
    import os

    _init(tp)
    reduce_from_tensor_model_parallel_region(torch.ones(2))  # the group works
    if _last():
        time.sleep(0.3)
        os._exit(3)  # the peer dies while the others wait in the next all-reduce
    start = time.monotonic()
    try:
        reduce_from_tensor_model_parallel_region(torch.ones(2))
    except consistency.CollectiveError as exc:
        seconds = time.monotonic() - start
        raise consistency.CollectiveError(f"{exc} [after {seconds:.1f} s]") from exc


@pytest.mark.parametrize("check", [False, True, "window"])
def test_dead_peer_gives_a_named_error_on_the_survivors(check):
    from megatron_core.testing import DistributedTestError

    with pytest.raises(DistributedTestError) as info:
        run_distributed(_run_dead_peer, 2, check, timeout=60)
    failures = info.value.failures
    assert failures[1].type_name == "WorkerDied"
    survivor = failures[0]
    assert survivor.type_name.endswith("CollectiveError"), survivor
    checked = check is not False  # in the window, the check's exchange is what waits
    op = "the consistency check's all-gather before all_reduce" if checked else "all_reduce"
    assert survivor.message.startswith(
        f"{op} on the tensor-model-parallel / model-parallel group (global ranks [0, 1]) failed "
        "(a peer process of the group died or closed its connection)"
    ), survivor.message
    seconds = float(survivor.message.rsplit("[after ", 1)[1].split(" s]")[0])
    assert seconds < _LIMIT_S


def _run_dead_peer(check):
    with consistency.check_mode(check):
        _dead_peer(dist.get_world_size())


# --- torch's TORCH_DISTRIBUTED_DEBUG=DETAIL -----------------------------------------------------


def _detail_mismatch():
    import datetime

    from megatron_core.tensor_parallel import _collectives

    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # what TORCH_DISTRIBUTED_DEBUG=DETAIL does
    try:
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=6))
    finally:
        dist.set_debug_level(previous)
    with consistency.check_mode(False):  # torch's fingerprint check alone
        try:
            _collectives.all_reduce(torch.ones(4 if _last() else 3), group)
        except MegatronCoreError as exc:
            return type(exc).__name__, str(exc)
    return "returned", ""


def test_torch_detail_mismatch_is_named():
    for kind, message in run_distributed(_detail_mismatch, 2, timeout=60):
        assert kind == "CollectiveError"
        assert message.startswith(
            "all_reduce on the process group of global ranks [0, 1] failed (torch's "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL check found the ranks in different calls)"
        ), message
        assert "Detected mismatch between collectives" in message
