"""Waiting for peers with a deadline: a rank that never arrives is named, not waited for.

# NOTE [ Peer deadline ]
1. Where this package waits for the peers of a gloo group (the agreement exchange of
   parallel_state and megatron_core.consistency, the collectives of tensor_parallel), it waits at
   most the peer deadline: ``MEGATRON_CORE_PEER_DEADLINE`` seconds, or
   :func:`set_peer_deadline` (every rank alike); ``0`` / ``off`` waits as long as the group's own
   timeout allows (torch's default: 30 minutes).
2. Default: 900 s. A peer that is late for legitimate work (loading or saving a checkpoint,
   a first iteration's compilation, a data loader starting on a loaded node) is late by seconds
   to minutes; a peer that took another branch (it skipped a backward, raised and exited its
   loop, waits in another group) never comes. 15 minutes is far above the first and still half
   of the group timeout that would otherwise end the wait, with a message naming nobody.
3. At the deadline every waiting rank writes "I am here" under the collective's key in the
   default group's store, gives its peers up to 5 s (at most the deadline) to do the same, and
   raises :class:`PeerDeadlineError` naming the ranks that never wrote: the ones that did not
   enter the collective. Nothing is written before the deadline: the happy path costs a
   dictionary update per wait. The key is the group's ranks, the operation and a count of this
   process's waits on that group, equal on ranks that made the same calls.
4. NCCL (and the per-device ``cuda:nccl,cpu:gloo`` map) is left to torch: NCCL's own watchdog
   ends a collective that a peer never joins after the group timeout, and a host-side wait would
   stall the device queue that the package's asynchronous NCCL work is built to keep full.
5. Every rank must use the same deadline: ``initialize_model_parallel`` agrees on it with its
   other arguments (a rank with another value raises on every rank).
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from megatron_core import compat, flags
from megatron_core.errors import MegatronCoreError

__all__ = [
    "DEADLINE_ENV",
    "DEFAULT_DEADLINE_S",
    "PeerDeadlineError",
    "peer_deadline",
    "set_peer_deadline",
    "wait",
]

DEADLINE_ENV = "MEGATRON_CORE_PEER_DEADLINE"
DEFAULT_DEADLINE_S = 900.0
_ROLL_CALL_S = 5.0  # at most this long a waiting rank gives its peers to report (rule 3)
_EXPLICIT: list[float | None | str] = ["unset"]  # set_peer_deadline's value; "unset": environment
_WAITS: dict[dist.ProcessGroup, int] = {}  # group -> waits made on it (rule 3)


class PeerDeadlineError(RuntimeError):
    """A peer did not enter a collective within the peer deadline (NOTE [ Peer deadline ]).
    A RuntimeError, as torch's own timeouts are, so the wrappers that name the collective and
    the group handle both alike."""


def peer_deadline() -> float | None:
    """Seconds a rank waits for its peers in a gloo collective (None: no deadline of its own)."""
    if _EXPLICIT[0] != "unset":
        return _EXPLICIT[0]  # type: ignore[return-value]
    seconds = flags.number(DEADLINE_ENV, off=True)  # 0 or a no: no deadline
    if seconds is None:
        return DEFAULT_DEADLINE_S
    return float(seconds) if seconds > 0 else None


def set_peer_deadline(seconds: float | None | str = "unset") -> None:
    """Set the peer deadline in this process (every rank must do the same): seconds > 0, None
    for none, or "unset" to read ``MEGATRON_CORE_PEER_DEADLINE`` again."""
    if seconds is not None and seconds != "unset":
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise MegatronCoreError(
                f"set_peer_deadline: seconds ({seconds!r}) must be a positive number, None or "
                '"unset"'
            )
        seconds = float(seconds)
    _EXPLICIT[0] = seconds


def _roll_call(group: dist.ProcessGroup, op: str, count: int) -> tuple[list[int], list[int]]:
    """(ranks that reported, ranks that did not) within the roll-call time (rule 3); both empty
    if the default store cannot be reached."""
    store = compat.default_store()
    ranks = dist.get_process_group_ranks(group)
    if store is None:
        return [], []
    prefix = f"megatron_core/late/{'-'.join(map(str, ranks))}/{op}/{count}/"
    store.set(prefix + str(dist.get_rank()), "1")
    end = time.monotonic() + min(_ROLL_CALL_S, peer_deadline() or _ROLL_CALL_S)
    while True:
        here = [r for r in ranks if store.check([prefix + str(r)])]
        if len(here) == len(ranks) or time.monotonic() >= end:
            return here, [r for r in ranks if r not in here]
        time.sleep(0.1)


def wait(work, op: str, group: dist.ProcessGroup) -> None:
    """Wait for ``work`` (an async collective of ``op`` over ``group``), at most the peer
    deadline on a gloo group (NOTE [ Peer deadline ]).

    Raises:
        PeerDeadlineError: the deadline passed; names the global ranks that never entered.
        RuntimeError: torch's own failure (a dead peer, the group's timeout), unchanged.
    """
    if work is None:
        return
    deadline = peer_deadline()
    if deadline is None or dist.get_backend(group) != "gloo":
        work.wait()
        return
    count = _WAITS[group] = _WAITS.get(group, 0) + 1
    start = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=deadline))
    except RuntimeError:
        if time.monotonic() - start < 0.99 * deadline:
            raise  # torch's own error, before the deadline
        here, missing = _roll_call(group, op, count)
        who = (
            f"global rank(s) {missing} never entered it (rank(s) {here} did)"
            if missing
            else "every rank reported at the deadline, so a peer was late by more than "
            f"{_ROLL_CALL_S:.0f} s"
            if here
            else "which rank is missing is unknown (no default store)"
        )
        raise PeerDeadlineError(
            f"timed out: {op} waited {deadline:g} s (the peer deadline, {DEADLINE_ENV}) for its "
            f"peers; {who}. A rank that skips a collective its peers make (a backward, a "
            "forward step, an evaluation pass) or that left its loop leaves the others waiting "
            "here"
        ) from None
