"""The package's environment variables, read in one place.

Every ``MEGATRON_CORE_*`` variable the package reads goes through this module: a yes/no flag
through :func:`flag`, a word from a fixed list through :func:`choice`, a number through
:func:`number`. Unset or empty means "not set" (None); a value outside the accepted ones raises
:class:`FlagError` naming the variable and the value, so a typo never reads as "off".
:data:`VARIABLES` lists them all with what each does (the manual's table,
docs/guides/environment-variables.md, is checked against it).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from megatron_core.errors import MegatronCoreError

__all__ = ["FlagError", "TRUE_VALUES", "FALSE_VALUES", "VARIABLES", "flag", "choice", "number"]

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off")


class FlagError(MegatronCoreError, ValueError):
    """An environment variable of the package holds a value it does not accept."""


class Variable(NamedTuple):
    """One environment variable: its name, the values it takes, and what it does."""

    name: str
    values: str
    meaning: str


VARIABLES = (
    Variable(
        "MEGATRON_CORE_CHECK_CONSISTENCY",
        "flag, or always / window",
        "consistency checks: 1 = check every collective, 0 = none, unset = the check window",
    ),
    Variable(
        "MEGATRON_CORE_CHECK_WINDOW",
        "integer >= 0",
        "collectives agreed per group in the default mode before any iteration (default 4096)",
    ),
    Variable(
        "MEGATRON_CORE_CHECK_ITERATIONS",
        "integer >= 0",
        "training iterations agreed whole in the default mode (default 2)",
    ),
    Variable(
        "MEGATRON_CORE_PEER_DEADLINE",
        "seconds > 0, or 0 / off",
        "how long a rank waits for a peer in the package's gloo collectives (default 900)",
    ),
    Variable(
        "MEGATRON_CORE_DEVICE", "cpu / cuda", "where the package puts tensors (default: detected)"
    ),
    Variable(
        "MEGATRON_CORE_SWITCH",
        "flag",
        "serve megatron-core's modules from this package in this process and its children",
    ),
    Variable(
        "MEGATRON_CORE_SWITCH_ANY_VERSION",
        "flag",
        "let the switch run on an untested megatron-core release (with a warning)",
    ),
    Variable(
        "MEGATRON_CORE_CUDA_ON_CPU",
        "flag",
        "the switch's CPU mode (default: on exactly when torch has no CUDA device)",
    ),
    Variable("MEGATRON_CORE_DEBUG", "flag", "the main job's debug output (as --debug)"),
    Variable(
        "MEGATRON_CORE_ATTENTION_DEBUG",
        "flag",
        "log the attention kernel every distinct call chose (fallbacks are logged anyway)",
    ),
    Variable(
        "MEGATRON_CORE_TEST_DEVICE",
        "cpu / cuda",
        "where the test harness's ranks put their tensors (default cpu)",
    ),
    Variable(
        "MEGATRON_CORE_TEST_NO_REUSE",
        "flag",
        "the test harness starts fresh worker processes for every call",
    ),
    Variable(
        "MEGATRON_CORE_TEST_START_METHOD",
        "spawn / fork / forkserver",
        "how the test harness starts its workers (default forkserver where available)",
    ),
)
_NAMES = {v.name for v in VARIABLES}


def _read(name: str) -> str | None:
    if name not in _NAMES:
        raise MegatronCoreError(f"flags: {name!r} is not one of the package's variables")
    value = os.environ.get(name, "").strip()
    return value or None


def flag(name: str, also: tuple[str, ...] = ()) -> bool | str | None:
    """Read yes/no variable ``name``: True for 1/true/yes/on, False for 0/false/no/off (any
    case), None when unset or empty; a word of ``also`` (lower-cased) is returned as it is.

    Raises:
        FlagError: any other value (the message names the variable and the value).
    """
    value = _read(name)
    if value is None:
        return None
    low = value.lower()
    if low in TRUE_VALUES:
        return True
    if low in FALSE_VALUES:
        return False
    if low in also:
        return low
    accepted = "/".join(TRUE_VALUES) + ", " + "/".join(FALSE_VALUES)
    accepted += "".join(f", {word}" for word in also)
    raise FlagError(f"{name}={value!r} is not one of {accepted} (or unset)")


def choice(name: str, choices: tuple[str, ...]) -> str | None:
    """Read variable ``name`` as one of ``choices`` (lower-cased), None when unset or empty.

    Raises:
        FlagError: any other value.
    """
    value = _read(name)
    if value is None:
        return None
    if value.lower() not in choices:
        raise FlagError(f"{name}={value!r} is not one of {', '.join(choices)} (or unset)")
    return value.lower()


def number(
    name: str, *, integer: bool = False, minimum: float = 0.0, off: bool = False
) -> float | int | None:
    """Read variable ``name`` as a number >= ``minimum`` (an int when ``integer``), None when
    unset or empty; with ``off``, a no (0/false/no/off/none) reads as 0.

    Raises:
        FlagError: a value that is not such a number.
    """
    value = _read(name)
    if value is None:
        return None
    if off and value.lower() in FALSE_VALUES + ("none",):
        return 0
    try:
        parsed = int(value) if integer else float(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed != parsed or parsed < minimum:
        kind = "an integer" if integer else "a number"
        raise FlagError(
            f"{name}={value!r} must be {kind} >= {minimum:g}" + (", or off" if off else "")
        )
    return parsed
