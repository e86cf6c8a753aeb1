"""Caller side of the multi-rank harness (private): pools of warm worker processes (start, reuse,
stop), the caller's half of protocol.py, and the errors a failed or late rank turns into.

harness.py hands :func:`run_task` a pickled call; this module sends it to the warm pool of that
world size, gathers the replies and raises if a rank failed. The rules (forkserver workers, warm
pools, failure grace, timeouts) are the docstring of harness.py, rules 1, 3, 6 and 8; the loop a
worker runs is worker.py.
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

from megatron_core import flags
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import protocol, worker

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
# Pools of warm workers.


def _context() -> multiprocessing.context.BaseContext:
    """forkserver with torch preloaded where the platform has it (a worker starts in
    milliseconds instead of importing torch for seconds), else spawn."""
    method = flags.choice(START_METHOD_ENV, ("spawn", "fork", "forkserver")) or (
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([worker.__name__])  # torch + megatron_core, once
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
                    target=worker.main,
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

    def gather(self, timeout: float) -> tuple[dict[int, protocol.Reply], list[int]]:
        """Replies by rank until all arrived, the timeout passed, or the grace after a failure
        ran out; returns (replies, ranks that did not reply)."""
        deadline = time.monotonic() + timeout
        replies: dict[int, protocol.Reply] = {}
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
                    if replies[rank].kind not in (protocol.OK, protocol.READY):
                        # See harness.py's module doc, rule 6: the others may be blocked in a
                        # collective.
                        deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        return replies, sorted(pending)

    def _receive(self, rank: int) -> protocol.Reply:
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            if conn.poll():
                return protocol.decode(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        proc.join(1.0)
        return protocol.Reply(protocol.DIED, exit_code=proc.exitcode)

    def send(self, message: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(message)

    def stop(self) -> None:
        """Ask the workers to exit, then kill whatever is left."""
        for conn in self.conns:
            try:
                conn.send_bytes(protocol.STOP)
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
    return flags.flag(NO_REUSE_ENV) is not True


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
# The caller's half of the protocol: a task out, the replies back, failures raised.


def run_task(
    world_size: int, payload: bytes, timeout: float, what: str
) -> dict[int, protocol.Reply]:
    """Run ``payload`` (``(fn, args, kwargs)`` pickled by pickling.dumps) on the warm pool of
    ``world_size`` ranks; returns the OK reply of every rank. The pool is discarded unless every
    rank replied OK and reset cleanly, or when reuse is off.

    Raises:
        DistributedTestError: a rank raised, died, or could not start (``what`` heads the message).
        DistributedTestTimeout: some ranks had not replied within ``timeout`` seconds.
    """
    __tracebackhide__ = True
    task = protocol.Task(list(sys.path), os.getcwd(), _pytest_rewritten_modules(), payload)
    message = protocol.encode(task)
    with _LOCK:
        pool = _acquire_pool(world_size)
        pool.healthy = False  # until every rank reports back cleanly
        try:
            pool.send(message)
            replies, missing = pool.gather(timeout)
            failures = _failures(replies)
            reset_failed = any(reply.reset_error for reply in replies.values())
            pool.healthy = not (failures or missing or reset_failed)
        finally:
            if not pool.healthy or not _reuse():
                _discard(pool)
    if failures or missing:
        _raise(what, failures, missing, timeout, world_size)
    return replies


def _pytest_rewritten_modules() -> list[str]:
    """Names of the caller's modules that pytest imported with assertion rewriting."""
    return [
        name
        for name, module in list(sys.modules.items())
        if type(getattr(module, "__loader__", None)).__name__ == "AssertionRewritingHook"
    ]


def _failures(replies: dict[int, protocol.Reply]) -> dict[int, RankFailure]:
    failures = {}
    for rank, reply in replies.items():
        if reply.kind == protocol.ERROR:
            error = reply.error
            exc = None
            if error.pickled is not None:
                try:
                    exc = pickle.loads(error.pickled)
                except Exception:
                    exc = None
            failures[rank] = RankFailure(rank, error.type_name, error.message, error.traceback, exc)
        elif reply.kind == protocol.STARTUP_ERROR:
            failures[rank] = RankFailure(
                rank, "WorkerStartupError", "start-up failed", reply.startup_traceback
            )
        elif reply.kind == protocol.DIED:
            message = f"the worker process died (exit code {reply.exit_code})"
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
