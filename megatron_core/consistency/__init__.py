"""When ranks disagree: agree first, then act, so no rank hangs, aborts or computes garbage.

The face of the consistency checks. checks.py holds the primitives (:func:`agree`,
:func:`agreed_errors`, the check-mode switch, :func:`named_failures`) and NOTE [ Agree before
acting ]; text.py the readable messages (group names, call sites, each rank's values) that every
rank of a disagreeing group raises alike.
"""

from megatron_core.consistency.checks import (
    CHECK_ENV,
    CollectiveError,
    RankDisagreementError,
    agree,
    agreed_errors,
    agreed_splits,
    check_collective,
    check_ids,
    check_mode,
    checked_all_reduce,
    collective_failed,
    describe_group,
    disable,
    enable,
    is_enabled,
    named_failures,
    set_enabled,
)

__all__ = [
    # checks.py
    "CHECK_ENV",
    "RankDisagreementError",
    "CollectiveError",
    "is_enabled",
    "enable",
    "disable",
    "set_enabled",
    "check_mode",
    "agree",
    "check_collective",
    "check_ids",
    "agreed_errors",
    "checked_all_reduce",
    "agreed_splits",
    "named_failures",
    "collective_failed",
    "describe_group",
]
