"""Run a function on N gloo ranks in spawned processes: the multi-rank test harness.

Test your own layers with it. The per-rank body must be a top-level (picklable) function; its return
value comes back to the caller, one entry per global rank::

    import torch
    import torch.distributed as dist
    from megatron_core import parallel_state
    from megatron_core.testing import distributed_test, run_distributed

    def _sum_of_ranks(scale):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        x = torch.tensor([float(dist.get_rank()) * scale])
        dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
        return x

    def test_sum_of_ranks():
        per_rank = run_distributed(_sum_of_ranks, 2, 10.0, timeout=60)  # index = global rank
        for x in per_rank:
            torch.testing.assert_close(x, torch.tensor([10.0]))

    @distributed_test(world_sizes=(1, 2, 4), timeout=60)
    def test_world_size():  # this body runs on every rank, once per world size
        assert dist.get_world_size() in (1, 2, 4)

A failing rank raises :class:`DistributedTestError` in the caller with the rank number and the
remote traceback; a call that runs past ``timeout`` raises :class:`DistributedTestTimeout`.

How it works:

1. Never a fork of the caller: each rank comes from a "forkserver" that imported torch and
   megatron_core once (a worker starts in milliseconds instead of seconds); where the platform has
   no forkserver, or ``MEGATRON_CORE_TEST_START_METHOD=spawn``, it is a "spawn" process. Either
   way it is a clean process, safe with threads and CUDA. Each task carries the caller's
   ``sys.path`` and working directory, so functions from test modules imported after the workers
   started still unpickle; modules that pytest assertion-rewrote are rewritten in the workers too.
2. Rendezvous through a file: ``init_process_group("gloo", init_method="file://<fresh temp dir>")``
   with RANK / WORLD_SIZE / LOCAL_RANK set; no port is guessed.
3. Warm pools: the workers of a world size stay alive and serve the next call (importing torch costs
   seconds per process). At most ``_MAX_LIVE_WORKERS`` workers live; the least recently used pool
   goes first. ``MEGATRON_CORE_TEST_NO_REUSE=1`` gives every call fresh workers.
4. Every call starts from the same state: parallel_state not initialized, device type "cpu", one
   torch thread, torch seeded with ``RESET_SEED``. After the call each rank destroys
   parallel_state, resets the RNG tracker and re-seeds; if that reset fails the pool is discarded
   (with a warning). A worker that imported megatron-core's own ``parallel_state`` (or another
   name the switch claims) without the switch counts as a failed reset: its ``install()`` would
   refuse forever after, so it is not reused.
5. Arguments and results travel as ``pickle`` bytes: tensors go by value, never through shared
   memory or file descriptors, and their storages are pickled by ``testing/pickling.py``, so a
   library that changes torch's own storage pickling (megatron-core 0.19 does at import) cannot
   make a rank import it while unpickling.
6. Failure: once a rank fails, the others get ``_FAILURE_GRACE_S`` seconds to report (they may be
   blocked in a collective that will never complete), then the pool is killed.
7. CUDA mode: with ``MEGATRON_CORE_TEST_DEVICE=cuda`` each rank binds GPU ``rank % count`` and
   the device type is "cuda". While the world fits the GPUs (one per rank) the group is
   ``init_process_group("cuda:nccl,cpu:gloo")`` (CUDA tensors over NCCL, CPU tensors over gloo);
   a larger world shares the GPUs and runs every collective over gloo, CUDA tensors included
   (NCCL refuses two ranks on one device), so one GPU runs every world size: NCCL at size 1.
   Without any GPU a call is skipped under pytest (the reason says so) and raises
   MegatronCoreError otherwise.
8. Timeout: the pool is killed (terminate, then kill, then join); no worker outlives the call.
   Pools are also shut down at interpreter exit, and workers exit on their own if the caller dies.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from megatron_core.errors import MegatronCoreError
from megatron_core.testing import pickling
from megatron_core.testing.pools import run_task
from megatron_core.testing.worker import TEST_DEVICE_ENV, harness_device_type

__all__ = ["run_distributed", "distributed_test"]


def _check_arguments(fn: Callable, world_size: Any, timeout: Any, args, kwargs) -> bytes:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MegatronCoreError(f"world_size ({world_size!r}) must be an integer >= 1")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise MegatronCoreError(f"timeout ({timeout!r}) must be a number of seconds > 0")
    if not callable(fn):
        raise MegatronCoreError(f"fn ({fn!r}) must be callable")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise MegatronCoreError(
            f"fn ({fn!r}) must be picklable (a function defined at the top level of an importable "
            f"module, not a lambda or a nested function): {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return pickling.dumps((fn, args, kwargs))
    except Exception as exc:
        raise MegatronCoreError(
            f"the arguments for {getattr(fn, '__qualname__', fn)} must be picklable: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _check_gpu_count(world_size: int) -> None:
    """CUDA mode (rule 7): skip (pytest) or refuse a call on a machine without a GPU."""
    if harness_device_type() != "cuda":
        return
    from megatron_core import device

    if device.accelerator_count() > 0:
        return
    reason = f"{TEST_DEVICE_ENV}=cuda: world size {world_size} needs a GPU, this machine has none"
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(reason)
    raise MegatronCoreError(reason)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and return each rank's result.

    When ``fn`` starts on a rank, torch.distributed is initialized (gloo, WORLD group; RANK,
    WORLD_SIZE and LOCAL_RANK set), torch uses one thread and is seeded with ``RESET_SEED``,
    parallel_state is not initialized and the device type is "cpu". ``fn`` may leave
    parallel_state initialized: it is destroyed after the call. See the module doc for how it
    works.

    Args:
        fn: a picklable (top-level) function; it must not destroy the default process group.
        world_size: the number of ranks, an integer >= 1.
        *args: positional arguments for ``fn`` (picklable).
        timeout: seconds the ranks get to finish, counted once the workers are up.
        **kwargs: keyword arguments for ``fn`` (picklable).

    Returns:
        The ranks' return values, indexed by global rank (unpickled copies).

    Raises:
        MegatronCoreError: ``world_size``, ``timeout``, ``fn`` or its arguments are invalid
            (raised before any process starts).
        DistributedTestError: a rank raised or died; the message has the rank numbers, the
            exception type and message, and the remote traceback.
        DistributedTestTimeout: some ranks had not finished within ``timeout``; every worker of
            the call was killed.
    """
    __tracebackhide__ = True
    payload = _check_arguments(fn, world_size, timeout, args, kwargs)
    _check_gpu_count(world_size)
    what = f"{getattr(fn, '__qualname__', repr(fn))} on {world_size} rank(s)"
    replies = run_task(world_size, payload, timeout, what)
    for rank, reply in replies.items():
        if reply.reset_error:
            warnings.warn(
                f"resetting rank {rank} after {fn!r} failed; the worker pool was discarded:\n"
                f"{reply.reset_error}",
                RuntimeWarning,
                stacklevel=2,
            )
    return [pickle.loads(replies[rank].result) for rank in range(world_size)]


def distributed_test(
    world_sizes: Sequence[int] = (1, 2, 4), timeout: float = 120.0
) -> Callable[[Callable[[], Any]], Callable[[int], None]]:
    """Decorate a per-rank test body: pytest runs it on every rank, once per world size.

    The decorated function takes no arguments and runs on each rank (use
    ``torch.distributed.get_rank()`` / ``get_world_size()``); pytest sees a test parametrized by
    ``world_size``. The body is kept picklable under the module attribute
    ``_distributed_body_<name>``, so the decorator only works on top-level functions.

    Args:
        world_sizes: the world sizes to run, a non-empty sequence of integers >= 1.
        timeout: seconds each run gets (see :func:`run_distributed`).
    """
    import pytest

    world_sizes = tuple(world_sizes)
    if not world_sizes:
        raise MegatronCoreError("world_sizes (()) must not be empty: the test would never run")
    for size in world_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MegatronCoreError(f"world_sizes ({world_sizes!r}) must hold integers >= 1")

    def decorate(body: Callable[[], Any]) -> Callable[[int], None]:
        if body.__qualname__ != body.__name__:
            raise MegatronCoreError(
                f"distributed_test needs a top-level function, got {body.__qualname__}"
            )
        name = body.__name__
        body.__qualname__ = body.__name__ = f"_distributed_body_{name}"
        setattr(sys.modules[body.__module__], body.__name__, body)

        @pytest.mark.parametrize("world_size", world_sizes)
        def test(world_size: int) -> None:
            run_distributed(body, world_size, timeout=timeout)

        test.__name__ = test.__qualname__ = name
        test.__module__, test.__doc__ = body.__module__, body.__doc__
        return test

    return decorate
