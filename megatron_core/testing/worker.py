"""Rank side of the multi-rank harness (harness.py): the loop each worker process runs.

A worker initializes gloo through the file rendezvous, replies READY, then runs the tasks the
caller sends (protocol.py) until it is told to STOP, resetting per-process state after each task
(see harness.py's module doc, rules 1, 2, 4, 5, 7 and 8). :func:`main` is the process target that
pools.py starts; the device-mode helpers here are also read by the caller and by tests.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback

from megatron_core import flags
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import pickling, protocol

RESET_SEED = 1234
TEST_DEVICE_ENV = "MEGATRON_CORE_TEST_DEVICE"

# ----------------------------------------------------------------------------------------------
# Device mode (harness rule 7), read on both sides.


def harness_device_type() -> str:
    """The harness's device type: "cuda" if ``MEGATRON_CORE_TEST_DEVICE=cuda``, else "cpu"."""
    return flags.choice(TEST_DEVICE_ENV, ("cpu", "cuda")) or "cpu"


def harness_backend(world_size: int) -> str:
    """The default group's backend for a harness world of ``world_size`` ranks (harness rule 7):
    ``cuda:nccl,cpu:gloo`` in CUDA mode when every rank has a GPU of its own, else ``gloo``."""
    from megatron_core import device

    if harness_device_type() == "cuda" and world_size <= device.accelerator_count():
        return "cuda:nccl,cpu:gloo"
    return "gloo"


def shares_gpus(world_size: int) -> bool:
    """True in CUDA mode when a world of ``world_size`` ranks shares GPUs, so that every
    collective, CUDA tensors included, runs over gloo (harness rule 7). A test whose code needs a
    collective gloo lacks for CUDA tensors (coalesced all-reduce, say) skips on this."""
    return harness_device_type() == "cuda" and harness_backend(world_size) == "gloo"


# ----------------------------------------------------------------------------------------------
# The worker process.


def main(rank: int, world_size: int, init_method: str, conn) -> None:
    """Serve the tasks from ``conn`` as rank ``rank`` of ``world_size`` until STOP or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    try:
        _init_worker(rank, world_size, init_method)
    except BaseException:
        reply = protocol.Reply(protocol.STARTUP_ERROR, startup_traceback=traceback.format_exc())
        conn.send_bytes(protocol.encode(reply))
        return
    conn.send_bytes(protocol.encode(protocol.Reply(protocol.READY, pid=os.getpid())))
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if task == protocol.STOP:
            break
        conn.send_bytes(_run_task(task))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_when_orphaned() -> None:
    parent = multiprocessing.parent_process()  # the caller, also under forkserver
    if parent is not None:
        parent.join()  # returns when the caller's end of the sentinel pipe closes
        os._exit(1)


def _init_worker(rank: int, world_size: int, init_method: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    from megatron_core import device

    torch.set_num_threads(1)
    # cuda mode: GPU rank % count; CUDA tensors over NCCL and CPU tensors over gloo while every
    # rank has a GPU of its own, everything over gloo when ranks share GPUs (NCCL refuses two
    # ranks on one device); cpu: plain gloo. Rule 7 of the harness's module doc.
    device.set_device_type(harness_device_type())
    device.set_current_device(rank)
    backend = harness_backend(world_size)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    error = _reset_process_state()
    if error is not None:
        raise MegatronCoreError(f"resetting the worker state failed:\n{error}")


def _run_task(data: bytes) -> bytes:
    try:
        task = protocol.decode(data)
        sys.path[:] = task.sys_path
        if task.rewritten:
            _PytestAssertFinder.install(task.rewritten)
        try:
            os.chdir(task.cwd)
        except OSError:
            pass
        fn, args, kwargs = pickle.loads(task.payload)
        from megatron_core import device

        device.set_device_type(harness_device_type())
        reply = protocol.Reply(protocol.OK, result=pickling.dumps(fn(*args, **kwargs)))
    except BaseException as exc:  # reported to the caller, whatever it is
        reply = protocol.Reply(protocol.ERROR, error=_describe(exc))
    return protocol.encode(reply._replace(reset_error=_reset_process_state()))


class _PytestAssertFinder(importlib.abc.MetaPathFinder):
    """Import the modules that pytest assertion-rewrote in the caller (test modules, conftest)
    with rewritten asserts here too, so a failing ``assert a == b`` shows both values."""

    names: set[str] = set()

    @classmethod
    def install(cls, names: list[str]) -> None:
        cls.names.update(names)
        if not any(isinstance(finder, cls) for finder in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _PytestAssertLoader(spec.loader.name, spec.loader.path)
            return spec
        return None


class _PytestAssertLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):  # never a cached .pyc: those hold the plain asserts
        from _pytest.assertion.rewrite import rewrite_asserts

        path = self.get_filename(fullname)
        source = self.get_data(path)
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path)
        return compile(tree, path, "exec", dont_inherit=True)


def _describe(exc: BaseException) -> protocol.RemoteError:
    cls = type(exc)
    type_name = cls.__qualname__
    if cls.__module__ != "builtins":
        type_name = f"{cls.__module__}.{type_name}"
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # drop _run_task
    text = "".join(traceback.format_exception(cls, exc, tb))
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # some exceptions pickle but do not unpickle
    except Exception:
        pickled = None
    return protocol.RemoteError(type_name, str(exc), text, pickled)


def _unswitched_megatron_modules() -> list[str]:
    """Names the switch claims that this process imported from megatron-core itself."""
    switch = sys.modules.get("megatron_core.megatron")
    if switch is not None:
        return switch._foreign_imports()
    return [name for name in ("megatron.core.parallel_state",) if name in sys.modules]


def _reset_process_state() -> str | None:
    """Undo what a task may have changed; returns the traceback text if that fails."""
    try:
        import torch
        import torch.distributed as dist

        from megatron_core import consistency, device, parallel_state

        parallel_state.destroy_model_parallel()  # also drops set_* overrides made without init
        try:
            from megatron_core.tensor_parallel.random import (
                get_cuda_rng_tracker,
                keep_device_stream_apart,
            )

            get_cuda_rng_tracker().reset()
            keep_device_stream_apart(False)  # draws come from the CPU generator again
        except (ImportError, AttributeError):
            pass
        device.set_device_type(None)
        consistency.set_mode(None)  # check mode follows the environment again
        consistency.set_peer_deadline("unset")  # and so does the peer deadline
        if not dist.is_initialized():
            raise MegatronCoreError("the default process group was destroyed by the function")
        unswitched = _unswitched_megatron_modules()
        if unswitched:  # every later megatron_core.megatron.install() here would refuse
            raise MegatronCoreError(
                f"the function imported megatron-core's own {', '.join(unswitched)} without the "
                "switch (install() first, or load megatron-core's file under a private name)"
            )
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.manual_seed(RESET_SEED)
        return None
    except BaseException:
        return traceback.format_exc()
