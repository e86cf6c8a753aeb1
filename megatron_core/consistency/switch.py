"""The switch of the consistency checks: which collectives are agreed before they run.

Three modes (:class:`CheckMode`); NOTE [ Check window ] says how the default one stays safe.

* ``WINDOW``, the default: the first ``N`` collectives the package issues on each process group
  are agreed (shapes, dtypes, arguments, contents where they must be equal), then none. ``N``
  (:func:`window_size`, default 4096, ``MEGATRON_CORE_CHECK_WINDOW``) covers a training
  iteration of usual models, where disagreements start: a batch cut differently, a vocabulary
  split computed locally, a shape off by one.
* ``ALWAYS`` (check mode): every collective is agreed. ``MEGATRON_CORE_CHECK_CONSISTENCY=1``,
  :func:`~megatron_core.consistency.enable`, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
* ``OFF``: nothing is agreed (megatron-core's behaviour: a disagreement hangs, aborts in gloo or
  gives wrong numbers). ``MEGATRON_CORE_CHECK_CONSISTENCY=0`` or
  :func:`~megatron_core.consistency.disable`.

# NOTE [ Check window ]
1. One counter per process group, keyed by the group's name (``ProcessGroup.group_name``:
   the same on every member, unique per communicator), counting the checks
   :func:`should_check` approved on that group. Every rank must run the same mode and window
   size; each agreement compares them (a difference raises at ``initialize_model_parallel``).
2. A check on a group is itself a collective of that group (one fixed-size all-gather), so while
   the ranks issue the same collectives, every member approves the same checks and the counters
   stay equal; the window closes on every member at the same count, and no member is ever in
   a check while another is in the collective it guards. The first collective that differs
   between the ranks is, inside the window, caught by its check (rule 1 of NOTE [ Agree before
   acting ]).
3. Setting the mode or the window size (every rank alike, as the functions say) restarts every
   group's window; a new communicator starts its own. One that ``initialize_model_parallel``
   reuses after a destroy (the package keeps communicators) keeps its count, which its members,
   with the same history, agree on.
4. A group with rare collectives (once an iteration: the gradient norm over the model-parallel
   group, the tied embeddings over the pipeline ends) would stay in its window for ``N``
   iterations. So every check also carries whether this rank has made ``N`` checks in all
   groups together (:func:`windows_done`: an iteration's worth has run), and a group closes its
   window after any check in which a member says so (:func:`close_window`). The decision is
   read from the gathered table, the same on every member, so rule 2 still holds.
5. Outside the window nothing is exchanged: the cost is a dictionary lookup per collective.
   A local check that needs no peer stays on after the window (token ids inside the
   vocabulary: :func:`~megatron_core.consistency.check_ids`).
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator

import torch.distributed as dist

from megatron_core import flags
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.agreement import add_agreed_setting

__all__ = [
    "CHECK_ENV",
    "WINDOW_ENV",
    "DEFAULT_WINDOW",
    "CheckMode",
    "mode",
    "set_mode",
    "is_enabled",
    "set_enabled",
    "enable",
    "disable",
    "check_mode",
    "window_size",
    "set_window",
    "should_check",
    "checked_count",
    "windows_done",
    "close_window",
]

CHECK_ENV = "MEGATRON_CORE_CHECK_CONSISTENCY"
WINDOW_ENV = "MEGATRON_CORE_CHECK_WINDOW"
DEFAULT_WINDOW = 4096


class CheckMode(enum.Enum):
    """Which collectives are agreed across their group before they run (module doc)."""

    OFF = "off"
    WINDOW = "window"
    ALWAYS = "always"


# [explicit mode or None, resolved mode or None (not read yet), window size or None (not read
# yet), checks made in all groups]; per-group counts of checks made (NOTE [ Check window ]).
_STATE: list = [None, None, None, 0]
_COUNTS: dict[str, int] = {}


def _from_environment() -> CheckMode:
    value = flags.flag(CHECK_ENV, also=("always", "window", "default"))
    if value is True or value == "always":
        return CheckMode.ALWAYS
    if value is False:
        return CheckMode.OFF
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"
    return CheckMode.ALWAYS if detail else CheckMode.WINDOW


def mode() -> CheckMode:
    """The mode in force: set by :func:`set_mode` (or enable/disable), else the environment
    (``MEGATRON_CORE_CHECK_CONSISTENCY``, then ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, read once
    and again after ``set_mode(None)``), else ``WINDOW``."""
    if _STATE[1] is None:
        _STATE[1] = _STATE[0] if _STATE[0] is not None else _from_environment()
    return _STATE[1]


def set_mode(new: CheckMode | str | None, *, restart_windows: bool = True) -> CheckMode | None:
    """Force ``new`` in this process (every rank must do the same), or None to follow the
    environment again; restarts every group's window (NOTE [ Check window ], rule 3) unless
    ``restart_windows`` is False (e.g. to compare modes within one run). Returns the previous
    explicit setting."""
    if new is not None and not isinstance(new, CheckMode):
        try:
            new = CheckMode(new)
        except ValueError:
            raise MegatronCoreError(
                f"set_mode: mode ({new!r}) must be a CheckMode, one of "
                f"{[m.value for m in CheckMode]}, or None"
            ) from None
    previous = _STATE[0]
    _STATE[0], _STATE[1] = new, None
    if restart_windows:
        _restart()
    return previous


def _restart() -> None:
    _COUNTS.clear()
    _STATE[3] = 0


def is_enabled() -> bool:
    """True in check mode (``ALWAYS``: every collective agreed)."""
    return mode() is CheckMode.ALWAYS


def set_enabled(enabled: bool | None) -> bool | None:
    """Check mode on (True: ``ALWAYS``), off (False: ``OFF``, not even the window), or None to
    follow the environment again; returns the previous setting as a bool (None: environment; a
    forced ``WINDOW`` reads as False: :func:`set_mode` restores any mode exactly)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise MegatronCoreError(f"set_enabled: enabled ({enabled!r}) must be True, False or None")
    new = None if enabled is None else (CheckMode.ALWAYS if enabled else CheckMode.OFF)
    previous = set_mode(new)
    return None if previous is None else previous is CheckMode.ALWAYS


def enable() -> None:
    """Turn check mode on in this process (every rank must do the same)."""
    set_mode(CheckMode.ALWAYS)


def disable() -> None:
    """Turn every check off in this process, the window too (every rank must do the same)."""
    set_mode(CheckMode.OFF)


@contextlib.contextmanager
def check_mode(enabled: bool | CheckMode | str = True) -> Iterator[None]:
    """Context manager: check mode on (True), off (False) or any :class:`CheckMode` inside the
    block, the previous setting after (each change restarts the windows)."""
    new = enabled if not isinstance(enabled, bool) else None
    previous = set_mode(
        new if new is not None else (CheckMode.ALWAYS if enabled else CheckMode.OFF)
    )
    try:
        yield
    finally:
        set_mode(previous)


def window_size() -> int:
    """Collectives agreed per group in ``WINDOW`` mode: :func:`set_window`, else
    ``MEGATRON_CORE_CHECK_WINDOW``, else :data:`DEFAULT_WINDOW`."""
    if _STATE[2] is None:
        size = flags.number(WINDOW_ENV, integer=True)
        _STATE[2] = DEFAULT_WINDOW if size is None else size
    return _STATE[2]


def set_window(size: int | None) -> None:
    """Agree the first ``size`` collectives of each group in ``WINDOW`` mode (None: the
    environment's or the default); restarts every window. Every rank must do the same."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise MegatronCoreError(f"set_window: size ({size!r}) must be an int >= 0 or None")
    _STATE[2] = size
    _restart()


def should_check(group: dist.ProcessGroup | None) -> bool:
    """Whether the collective about to run on ``group`` (None: WORLD) is agreed first: always
    in check mode, never when off, and in ``WINDOW`` mode while the group's count is below
    :func:`window_size` (counting this one; NOTE [ Check window ]). Never for a one-rank group.
    """
    current = _STATE[1] if _STATE[1] is not None else mode()
    if current is CheckMode.OFF:
        return False
    group = dist.group.WORLD if group is None else group
    if current is CheckMode.ALWAYS:
        return dist.get_world_size(group) > 1
    key = group.group_name
    count = _COUNTS.get(key, 0)
    if count >= (_STATE[2] if _STATE[2] is not None else window_size()):
        return False
    if dist.get_world_size(group) == 1:
        return False
    _COUNTS[key] = count + 1
    _STATE[3] += 1
    return True


def checked_count(group: dist.ProcessGroup | None) -> int:
    """How many collectives on ``group`` (None: WORLD) the window has agreed so far."""
    group = dist.group.WORLD if group is None else group
    return _COUNTS.get(group.group_name, 0)


def windows_done() -> bool:
    """True once this rank has made :func:`window_size` window checks in all groups together
    since the windows (re)started (NOTE [ Check window ], rule 4)."""
    return _STATE[3] >= window_size()


def close_window(group: dist.ProcessGroup | None) -> None:
    """End ``group``'s window now (called on every member alike: rule 4)."""
    group = dist.group.WORLD if group is None else group
    _COUNTS[group.group_name] = max(_COUNTS.get(group.group_name, 0), window_size())


def _describe() -> str:
    try:
        return f"{mode().value}, window {window_size()}"
    except MegatronCoreError as exc:  # a bad environment value: shown, and raised on first use
        return f"invalid ({exc})"


# Every rank must run the same mode and window (NOTE [ Check window ], rule 1):
# initialize_model_parallel compares them over WORLD.
add_agreed_setting("consistency mode", _describe)
