"""The messages between the caller (pools.py) and a rank (worker.py) of the multi-rank harness.

Each message is one ``Connection.send_bytes``: the caller sends a :class:`Task` (or :data:`STOP`),
the rank answers with one :class:`Reply`. A worker's first reply is READY or STARTUP_ERROR; after
that it answers every task with OK or ERROR. DIED is never sent: the caller makes it of a worker
that exited without answering. The function, its arguments and its result inside the messages
are bytes pickled by pickling.py (see rule 5 of harness.py's module doc).
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

from megatron_core.testing.pickling import PROTOCOL

__all__ = [
    "STOP",
    "READY",
    "STARTUP_ERROR",
    "OK",
    "ERROR",
    "DIED",
    "Task",
    "RemoteError",
    "Reply",
    "encode",
    "decode",
]

STOP = b"stop"  # sent raw, in place of a Task: the worker leaves its loop

# Reply kinds.
READY = "ready"
STARTUP_ERROR = "startup_error"
OK = "ok"
ERROR = "error"
DIED = "died"


class Task(NamedTuple):
    """One call for a rank to run, with what it needs from the caller's process."""

    sys_path: list[str]  # the caller's sys.path, so functions of late-imported modules unpickle
    cwd: str  # the caller's working directory
    rewritten: list[str]  # the modules pytest assertion-rewrote in the caller
    payload: bytes  # (fn, args, kwargs), pickled by pickling.dumps


class RemoteError(NamedTuple):
    """What the function raised on a rank."""

    type_name: str  # the exception's class, qualified by its module unless a builtin
    message: str  # str(exception)
    traceback: str  # the formatted traceback, as the rank saw it
    pickled: bytes | None  # the exception itself, None where it does not pickle and unpickle


class Reply(NamedTuple):
    """A rank's answer. Each field has one meaning and is set only for the kinds beside it."""

    kind: str  # READY, STARTUP_ERROR, OK, ERROR or DIED
    pid: int | None = None  # READY: the worker's process id
    startup_traceback: str = ""  # STARTUP_ERROR: why the worker could not start
    result: bytes | None = None  # OK: the function's return value, pickled by pickling.dumps
    error: RemoteError | None = None  # ERROR: what the function raised
    reset_error: str | None = None  # OK, ERROR: the traceback of a failed state reset, else None
    exit_code: int | None = None  # DIED: the worker's exit code (None if it had not exited)


def encode(message: Task | Reply) -> bytes:
    """The bytes that carry ``message`` over a worker's pipe."""
    return pickle.dumps(message, protocol=PROTOCOL)


def decode(data: bytes) -> Task | Reply:
    """The message that :func:`encode` turned into ``data``."""
    return pickle.loads(data)
