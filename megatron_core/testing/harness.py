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
   parallel_state, resets the RNG tracker and re-seeds; if that reset fails the pool is discarded.
5. Arguments and results travel as plain ``pickle`` bytes: tensors go by value, never through
   shared memory or file descriptors.
6. Failure: once a rank fails, the others get ``_FAILURE_GRACE_S`` seconds to report (they may be
   blocked in a collective that will never complete), then the pool is killed.
7. CUDA mode: with ``MEGATRON_CORE_TEST_DEVICE=cuda`` each rank binds GPU ``rank % count``, the
   group is ``init_process_group("cuda:nccl,cpu:gloo")`` (CUDA tensors over NCCL, CPU tensors
   over gloo) and the device type is "cuda". A world size above the GPU count is skipped under
   pytest (the reason names both numbers) and raises MegatronCoreError otherwise.
8. Timeout: the pool is killed (terminate, then kill, then join); no worker outlives the call.
   Pools are also shut down at interpreter exit, and workers exit on their own if the caller dies.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (its atexit hook must be registered before ours)
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from megatron_core.errors import MegatronCoreError
from megatron_core.testing.worker import (
    _PROTOCOL,
    _STOP,
    RESET_SEED,
    TEST_DEVICE_ENV,
    _pytest_rewritten_modules,
    _worker_main,
    harness_device_type,
)

__all__ = [
    "DistributedTestError",
    "DistributedTestTimeout",
    "RankFailure",
    "run_distributed",
    "distributed_test",
    "shutdown_pools",
    "RESET_SEED",
]

NO_REUSE_ENV = "MEGATRON_CORE_TEST_NO_REUSE"
START_METHOD_ENV = "MEGATRON_CORE_TEST_START_METHOD"
_FAILURE_GRACE_S = 2.0
_STARTUP_TIMEOUT_S = 120.0
_MAX_LIVE_WORKERS = 10


@dataclasses.dataclass
class RankFailure:
    """How one rank failed: exception type and message, remote traceback, and the exception itself
    (None when it could not be pickled back)."""

    rank: int
    type_name: str
    message: str
    traceback: str
    exception: BaseException | None = None


class DistributedTestError(MegatronCoreError):
    """A rank failed (raised, died, or could not start); ``failures`` maps rank -> RankFailure."""

    def __init__(self, message: str, failures: dict[int, RankFailure] | None = None):
        super().__init__(message)
        self.failures = failures or {}


class DistributedTestTimeout(DistributedTestError):
    """Some ranks had not finished within the timeout; every worker of that call was killed."""


# ----------------------------------------------------------------------------------------------
# Caller side: pools of warm workers.


def _context() -> multiprocessing.context.BaseContext:
    """forkserver with torch preloaded where the platform has it (a worker starts in
    milliseconds instead of importing torch for seconds), else spawn."""
    method = os.environ.get(START_METHOD_ENV) or (
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["megatron_core.testing.worker"])  # torch + megatron_core, once
    return ctx


class _Pool:
    """``world_size`` spawned workers sharing one gloo WORLD group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.owner_pid = os.getpid()
        self.healthy = False  # set once every rank reported ready / finished a task cleanly
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.tmpdir = tempfile.mkdtemp(prefix="megatron_core_ranks_")
        init_method = "file://" + os.path.join(self.tmpdir, "rendezvous")
        ctx = _context()
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, init_method, child_conn),
                    name=f"megatron_core-rank{rank}-of-{world_size}",
                )
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
        except BaseException:
            self.kill()
            raise

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def gather(self, timeout: float) -> tuple[dict[int, tuple], list[int]]:
        """Replies by rank until all arrived, the timeout passed, or the grace after a failure
        ran out; returns (replies, ranks that did not reply)."""
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple] = {}
        pending = set(range(self.world_size))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            by_object = {self.conns[r]: r for r in pending}
            by_object.update({self.procs[r].sentinel: r for r in pending})
            for obj in multiprocessing.connection.wait(list(by_object), timeout=remaining):
                rank = by_object[obj]
                if rank in pending:
                    pending.discard(rank)
                    replies[rank] = self._receive(rank)
                    if replies[rank][0] not in ("ok", "ready"):
                        # See module doc, rule 6: the others may be blocked in a collective.
                        deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        return replies, sorted(pending)

    def _receive(self, rank: int) -> tuple:
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        proc.join(1.0)
        return ("died", proc.exitcode)

    def send(self, message: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(message)

    def stop(self) -> None:
        """Ask the workers to exit, then kill whatever is left."""
        for conn in self.conns:
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate, then kill, then join every worker; remove the rendezvous directory."""
        if self.owner_pid != os.getpid():
            return  # a forked copy of the caller does not own these workers
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self.tmpdir, ignore_errors=True)


_POOLS: collections.OrderedDict[int, _Pool] = collections.OrderedDict()  # LRU order, world size
_LOCK = threading.RLock()


def _reuse() -> bool:
    return os.environ.get(NO_REUSE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def _acquire_pool(world_size: int) -> _Pool:
    """The warm pool for ``world_size``; a new one (waited for) if there is none or it is broken."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None and not (pool.healthy and all(p.is_alive() for p in pool.procs)):
        pool.kill()
        pool = None
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > (
            _MAX_LIVE_WORKERS
        ):
            _POOLS.popitem(last=False)[1].stop()  # least recently used first
        pool = _start_pool(world_size)
    _POOLS[world_size] = pool  # most recently used
    return pool


def _start_pool(world_size: int) -> _Pool:
    __tracebackhide__ = True
    pool = _Pool(world_size)
    try:
        replies, missing = pool.gather(_STARTUP_TIMEOUT_S)
    except BaseException:
        pool.kill()
        raise
    failures = _failures(replies)
    if failures or missing:
        pool.kill()
        what = f"starting {world_size} worker process(es)"
        _raise(what, failures, missing, _STARTUP_TIMEOUT_S, world_size)
    pool.healthy = True
    return pool


def _discard(pool: _Pool) -> None:
    if _POOLS.get(pool.world_size) is pool:
        del _POOLS[pool.world_size]
    pool.kill()


def shutdown_pools() -> None:
    """Stop every warm worker (run at interpreter exit and at the end of a pytest session)."""
    with _LOCK:
        while _POOLS:
            _POOLS.popitem()[1].stop()


atexit.register(shutdown_pools)


def _worker_pids(world_size: int) -> list[int] | None:
    """The pids of the warm pool for ``world_size`` (None if there is none); for tests."""
    with _LOCK:
        pool = _POOLS.get(world_size)
        return None if pool is None else pool.pids()


# ----------------------------------------------------------------------------------------------
# The public entry points.


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
        return pickle.dumps((fn, args, kwargs), protocol=_PROTOCOL)
    except Exception as exc:
        raise MegatronCoreError(
            f"the arguments for {getattr(fn, '__qualname__', fn)} must be picklable: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _check_gpu_count(world_size: int) -> None:
    """CUDA mode (rule 7): skip (pytest) or refuse a world larger than the GPU count."""
    if harness_device_type() != "cuda":
        return
    from megatron_core import device

    count = device.accelerator_count()
    if world_size <= count:
        return
    reason = (
        f"{TEST_DEVICE_ENV}=cuda: world size {world_size} needs {world_size} GPUs, "
        f"this machine has {count}"
    )
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
    rewritten = _pytest_rewritten_modules()
    task = pickle.dumps((list(sys.path), os.getcwd(), rewritten, payload), protocol=_PROTOCOL)
    with _LOCK:
        pool = _acquire_pool(world_size)
        pool.healthy = False  # until every rank reports back cleanly
        try:
            pool.send(task)
            replies, missing = pool.gather(timeout)
            failures = _failures(replies)
            reset_errors = [(r, reply[-1]) for r, reply in replies.items() if reply[-1]]
            pool.healthy = not (failures or missing or reset_errors)
        finally:
            if not pool.healthy or not _reuse():
                _discard(pool)
    if failures or missing:
        name = getattr(fn, "__qualname__", repr(fn))
        _raise(f"{name} on {world_size} rank(s)", failures, missing, timeout, world_size)
    for rank, text in reset_errors:
        warnings.warn(
            f"resetting rank {rank} after {fn!r} failed; the worker pool was discarded:\n{text}",
            RuntimeWarning,
            stacklevel=2,
        )
    return [pickle.loads(replies[rank][1]) for rank in range(world_size)]


def _failures(replies: dict[int, tuple]) -> dict[int, RankFailure]:
    failures = {}
    for rank, reply in replies.items():
        kind = reply[0]
        if kind == "error":
            type_name, message, text, pickled = reply[1]
            exc = None
            if pickled is not None:
                try:
                    exc = pickle.loads(pickled)
                except Exception:
                    exc = None
            failures[rank] = RankFailure(rank, type_name, message, text, exc)
        elif kind == "startup_error":
            failures[rank] = RankFailure(rank, "WorkerStartupError", "start-up failed", reply[1])
        elif kind == "died":
            message = f"the worker process died (exit code {reply[1]})"
            failures[rank] = RankFailure(rank, "WorkerDied", message, "")
    return failures


def _raise(what, failures, missing, timeout, world_size) -> None:
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this frame
    if not failures:
        raise DistributedTestTimeout(
            f"{what} timed out after {timeout:g} s: rank(s) {missing} had not finished; "
            f"all {world_size} worker(s) were killed"
        )
    lines = [f"{what} failed:"]
    texts: dict[str, list[int]] = {}
    for rank, failure in sorted(failures.items()):
        lines.append(f"  rank {rank}: {failure.type_name}: {failure.message}")
        if failure.traceback:
            texts.setdefault(failure.traceback, []).append(rank)
    if missing:
        lines.append(
            f"  rank(s) {missing} had not finished {_FAILURE_GRACE_S:g} s after the failure "
            "(probably blocked in a collective) and were killed"
        )
    for text, ranks in texts.items():
        lines.append(f"\n--- remote traceback of rank(s) {ranks} ---\n{text.rstrip()}")
    raise DistributedTestError("\n".join(lines), failures)


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
