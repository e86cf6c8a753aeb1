"""When ranks disagree: agree first, then act, so no rank hangs, aborts or computes garbage.

The face of the consistency checks. switch.py holds the switch (off, the default window of the
first iterations and the per-iteration digest after it, always: check mode) and NOTE [ Check
window ]; marks.py the iteration marks and where the digest is compared; digest.py the records
and their comparison; checks.py the primitives (:func:`agree`, :func:`check_collective`,
:func:`agreed_errors`) and NOTE [ Agree before acting ]; text.py the readable messages (group
names, call sites, each rank's values) that every rank of a disagreeing group raises alike, and
:func:`named_failures`. The peer deadline (a rank that never
arrives is named instead of waited for: NOTE [ Peer deadline ]) lives in
parallel_state/deadline.py, below the agreement it guards; its settings are re-exported here.
"""

from megatron_core.consistency.checks import (
    CollectiveError,
    RankDisagreementError,
    agree,
    agreed_errors,
    agreed_splits,
    check_collective,
    check_ids,
    checked_all_reduce,
    collective_failed,
    describe_group,
    named_failures,
    should_check,
)
from megatron_core.consistency.marks import compare_now, iteration, note_iteration
from megatron_core.consistency.switch import (
    CHECK_ENV,
    DEFAULT_ITERATIONS,
    DEFAULT_WINDOW,
    ITERATIONS_ENV,
    WINDOW_ENV,
    CheckMode,
    check_mode,
    checked_count,
    close_window,
    group_window_done,
    iterations_seen,
    mode,
    set_mode,
    set_window,
    set_window_iterations,
    window_iterations,
    window_size,
    windows_done,
)
from megatron_core.parallel_state.deadline import (
    DEADLINE_ENV,
    DEFAULT_DEADLINE_S,
    PeerDeadlineError,
    peer_deadline,
    set_peer_deadline,
)

__all__ = [
    # switch.py
    "CHECK_ENV",
    "WINDOW_ENV",
    "ITERATIONS_ENV",
    "DEFAULT_WINDOW",
    "DEFAULT_ITERATIONS",
    "CheckMode",
    "mode",
    "set_mode",
    "check_mode",
    "window_size",
    "set_window",
    "window_iterations",
    "set_window_iterations",
    "iterations_seen",
    "checked_count",
    "windows_done",
    "group_window_done",
    "close_window",
    # marks.py
    "iteration",
    "note_iteration",
    "compare_now",
    # checks.py
    "RankDisagreementError",
    "CollectiveError",
    "agree",
    "should_check",
    "check_collective",
    "check_ids",
    "agreed_errors",
    "checked_all_reduce",
    "agreed_splits",
    "named_failures",
    "collective_failed",
    "describe_group",
    # parallel_state/deadline.py
    "DEADLINE_ENV",
    "DEFAULT_DEADLINE_S",
    "PeerDeadlineError",
    "peer_deadline",
    "set_peer_deadline",
]
