"""The switch of the consistency checks: which collectives are agreed, recorded or left alone.

Three modes (:class:`CheckMode`); NOTE [ Check window ] says how the default one stays safe.

* ``WINDOW``, the default: the collectives of the first training iterations are agreed (shapes,
  dtypes, arguments, contents where they must be equal); after them each collective is recorded
  in a per-iteration digest that the ranks compare once per iteration and group, and the first
  collective of each group in an iteration is still agreed. Two iterations by default
  (:func:`window_iterations`, ``MEGATRON_CORE_CHECK_ITERATIONS``); before any iteration is seen,
  a count of collectives per group stands in (:func:`window_size`, default 4096,
  ``MEGATRON_CORE_CHECK_WINDOW``).
* ``ALWAYS`` (check mode): every collective is agreed. ``MEGATRON_CORE_CHECK_CONSISTENCY=1``,
  :func:`set_mode` / :func:`check_mode`, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
* ``OFF``: nothing is agreed or recorded (megatron-core's behaviour: a disagreement hangs,
  aborts in gloo or gives wrong numbers). ``MEGATRON_CORE_CHECK_CONSISTENCY=0`` or
  ``set_mode("off")``.

This module holds the settings and the window's state, and decides for each collective
(:func:`decide`); marks.py marks the iterations, digest.py keeps and compares the records.

# NOTE [ Check window ]
1. Iterations. An iteration begins at a mark (marks.py). Strongest first: an
   :func:`~megatron_core.consistency.iteration` block (the schedules wrap each
   ``forward_backward_func`` call, ``kind="eval"`` when ``forward_only``; the main job its
   step), ``finalize_model_grads``, a torch optimizer's ``step`` (a global pre-step hook), and,
   in a loop with none of these, a backward pass: the first package collective outside any
   backward after one inside a backward begins the next iteration (there, each forward and
   backward is an iteration). A kind of mark counts only while no stronger one has been seen;
   the first mark of a stronger kind starts the count again and reopens every group (every
   rank sees it at the same point), and a mark inside a block counts nothing. Training
   iterations 1..I are agreed whole -- forward, backward, gradient reductions, the optimizer's
   collectives -- and the window closes when iteration I + 1 begins.
2. Closing is decided in an agreement, never alone: a rank whose window is over says so in the
   next check on each group (a slot of the exchanged table, not compared), and the group closes
   after that check on every member at once (NOTE [ Agree before acting ], rule 2). No member
   is ever in a check while another is in the collective it guards, and the first collective
   that differs between the ranks is, inside the window, caught by its check.
3. What the window reopens: a group whose first check comes after the window closed (a group
   created later) is agreed until the next iteration begins; the first evaluation iteration
   (``kind="eval"``) after the window reopens every group for that iteration.
4. Fallback before any iteration is seen (a program that marks none and runs no backward
   through a package collective): one counter per process group, keyed by the group's name
   (the same on every member), counts the checks made on it; a member whose count reached
   ``N`` = :func:`window_size`, or that has made ``N`` checks in all groups together, says the
   window is over in its next check on the group (rule 2). ``N = 0`` closes every group at its
   first collective.
5. After the window, the digest (digest.py): every collective the package issues on a closed
   group appends its record -- op, shape, dtype, the arguments and a device-side checksum of
   the contents the window would have agreed -- to its group's list, locally. Once per
   iteration every rank compares, group by group in the order of their names (the same on
   every rank: no two ranks wait on each other's group), one fixed-size exchange of the lists'
   hash: at the end of an iteration block, or at the first optimizer step inside it; at
   ``finalize_model_grads``, an optimizer step or a backward mark where that is the strongest
   mark (rule 1). The exchange runs where the window's does (a device-only group's on its gloo
   shadow: NOTE [ Host-side agreement ]). Where the hashes differ, the records travel and every
   rank of the group raises RankDisagreementError naming the first collective that differs,
   with what it was in the iteration before, before the optimizer step applies anything.
6. Heads: the first collective on each closed group after an iteration begins is agreed as in
   the window. A disagreement that starts with the data (a batch or sequence length that
   differs on one rank) reaches every group first there, so it raises instead of aborting gloo.
   A backward mark is made at such a collective: its group's digest exchange agrees it too.
7. What is guaranteed. In the window: every disagreement of a package collective raises on
   every rank of its group before the collective. After it: a disagreement in an iteration's
   first collective on a group raises before that collective; any other raises at the
   iteration's digest, unless its collective itself breaks first -- sizes that differ in an
   all-reduce, all-gather or reduce-scatter abort gloo's process (NCCL hangs or reads the
   wrong bytes), a collective one rank skips leaves its peers waiting (named by the peer
   deadline) -- which the package cannot prevent without an exchange per collective (check
   mode). Local checks that need no peer run for good, in the window and after (ids outside
   the vocabulary, an input whose dtype is not the layer's, a sequence its split cannot
   divide); a rank that fails one alone leaves its peers in the next collective until the peer
   deadline names it. Never checked: a program that marks no iteration after the fallback
   closed (no digest is compared), raw torch.distributed calls, and the values of tensors the
   window does not checksum either (activations, gradients).
8. Every rank must run the same mode, window size and iteration count; each agreement and each
   digest compares them (a difference raises at ``initialize_model_parallel``). Setting any of
   them (every rank alike) restarts every window, the digest and the iteration count.
9. Cost after the window: per collective, a dictionary lookup and a tuple appended (a checksum
   kernel for the few collectives with contents); per iteration and group, one 128-byte
   all-gather for the head and one for the digest (one for both at a backward mark). On a
   GPU nothing waits for the device per collective: the records are host values and the
   checksums stay on the device until the digest reads them back once per iteration (with the
   head's contents, where it has any); the embedding's range check (rule 7) reads its ids'
   min and max once per forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Iterator

import torch.distributed as dist

from megatron_core import compat, flags
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.agreement import add_agreed_setting

__all__ = [
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
    "describe_settings",
    "close_window",
]

CHECK_ENV = "MEGATRON_CORE_CHECK_CONSISTENCY"
WINDOW_ENV = "MEGATRON_CORE_CHECK_WINDOW"
ITERATIONS_ENV = "MEGATRON_CORE_CHECK_ITERATIONS"
DEFAULT_WINDOW = 4096
DEFAULT_ITERATIONS = 2

# What decide() answers for one collective.
SKIP = 0  # nothing: mode off, a one-rank group
CHECK = 1  # agree first (in the window, or check mode)
FOLD = 2  # after the window: record it in the digest (rule 5)
HEAD = 3  # after the window, the group's first in the iteration: record and agree (rule 6)
MARK_FIRST = 4  # a backward mark is due (rule 1): mark (and compare), then decide again


class CheckMode(enum.Enum):
    """Which collectives are agreed across their group before they run (module doc)."""

    OFF = "off"
    WINDOW = "window"
    ALWAYS = "always"


@dataclasses.dataclass
class _Settings:
    """What every rank must share: the forced mode (None: the environment's), and the mode, the
    window size and the iteration count in force (None: not read from the environment yet)."""

    forced: CheckMode | None = None
    resolved: CheckMode | None = None
    window: int | None = None
    iterations: int | None = None


@dataclasses.dataclass
class Window:
    """Where the windows stand (NOTE [ Check window ]); reset by every setting change."""

    checks: int = 0  # checks made in all groups together (rule 4)
    marks: int = 0  # iterations begun, of any kind (rule 1)
    train_marks: int = 0  # training iterations begun
    eval_seen: bool = False  # an evaluation iteration has begun since the window closed
    reopened_at: int = -1  # ``marks`` when the first evaluation iteration reopened the groups
    depth: int = 0  # nesting of iteration() blocks: only the outermost counts
    strongest: int = -1  # the strongest kind of mark seen (rule 1: SOURCES)
    in_backward: bool = False  # a collective ran inside a backward since the last outside one
    compared: bool = False  # the digest was compared inside the current outermost block
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # group name -> checks
    first_mark: dict[str, int] = dataclasses.field(default_factory=dict)  # group -> marks then
    # groups closed in an agreement (rule 2), and those the next digest compares (rule 5: the
    # closed ones and those an evaluation reopened since the last digest), by name
    closed: dict[str, dist.ProcessGroup] = dataclasses.field(default_factory=dict)
    digested: dict[str, dist.ProcessGroup] = dataclasses.field(default_factory=dict)
    heads: set[str] = dataclasses.field(default_factory=set)  # rule 6: next one is agreed


SOURCES = {"backward": 0, "optimizer": 1, "finalize": 2, "block": 3}  # rule 1: weakest first
_SETTINGS = _Settings()
_WINDOW = Window()
_RESTART_HOOKS: list = []  # called on every restart (the digest drops its records)


def _from_environment() -> CheckMode:
    value = flags.flag(CHECK_ENV, also=("always", "window", "default"))
    if value is True or value == "always":
        return CheckMode.ALWAYS
    if value is False:
        return CheckMode.OFF
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"
    return CheckMode.ALWAYS if detail else CheckMode.WINDOW


def mode() -> CheckMode:
    """The mode in force: set by :func:`set_mode` (or inside :func:`check_mode`), else the
    environment (``MEGATRON_CORE_CHECK_CONSISTENCY``, then ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
    read once and again after ``set_mode(None)``), else ``WINDOW``."""
    if _SETTINGS.resolved is None:
        forced = _SETTINGS.forced
        _SETTINGS.resolved = forced if forced is not None else _from_environment()
    return _SETTINGS.resolved


def set_mode(new: CheckMode | str | None, *, restart_windows: bool = True) -> CheckMode | None:
    """Force ``new`` in this process (every rank must do the same), or None to follow the
    environment again; restarts every group's window (NOTE [ Check window ], rule 8) unless
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
    previous = _SETTINGS.forced
    _SETTINGS.forced, _SETTINGS.resolved = new, None
    if restart_windows:
        _restart()
    return previous


def _restart() -> None:
    global _WINDOW
    depth = _WINDOW.depth  # a restart inside an iteration() block keeps the block's nesting
    _WINDOW = Window(depth=depth)
    for hook in _RESTART_HOOKS:
        hook()


def on_restart(hook) -> None:
    """Call ``hook()`` whenever the windows restart (digest.py registers its reset)."""
    _RESTART_HOOKS.append(hook)


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
    """Collectives agreed per group in ``WINDOW`` mode before any iteration is seen
    (NOTE [ Check window ], rule 4): :func:`set_window`, else ``MEGATRON_CORE_CHECK_WINDOW``,
    else :data:`DEFAULT_WINDOW`."""
    if _SETTINGS.window is None:
        size = flags.number(WINDOW_ENV, integer=True)
        _SETTINGS.window = DEFAULT_WINDOW if size is None else size
    return _SETTINGS.window


def set_window(size: int | None) -> None:
    """Agree the first ``size`` collectives of each group in ``WINDOW`` mode while no iteration
    is seen (None: the environment's or the default); restarts every window. Every rank must do
    the same."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise MegatronCoreError(f"set_window: size ({size!r}) must be an int >= 0 or None")
    _SETTINGS.window = size
    _restart()


def window_iterations() -> int:
    """Training iterations agreed whole in ``WINDOW`` mode (NOTE [ Check window ], rule 1):
    :func:`set_window_iterations`, else ``MEGATRON_CORE_CHECK_ITERATIONS``, else
    :data:`DEFAULT_ITERATIONS`."""
    if _SETTINGS.iterations is None:
        count = flags.number(ITERATIONS_ENV, integer=True)
        _SETTINGS.iterations = DEFAULT_ITERATIONS if count is None else count
    return _SETTINGS.iterations


def set_window_iterations(count: int | None) -> None:
    """Agree the first ``count`` training iterations whole in ``WINDOW`` mode (None: the
    environment's or the default); restarts every window and the iteration count. Every rank
    must do the same."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise MegatronCoreError(
            f"set_window_iterations: count ({count!r}) must be an int >= 0 or None"
        )
    _SETTINGS.iterations = count
    _restart()


def window() -> Window:
    """The window's state now (a restart replaces it: read it again after one)."""
    return _WINDOW


def counts(source: str) -> bool:
    """Whether a mark of ``source`` counts now: no stronger kind of mark was seen (rule 1)."""
    return SOURCES[source] >= _WINDOW.strongest


def mark(source: str, kind: str) -> None:
    """Begin an iteration of ``kind`` marked by ``source`` (the caller checked :func:`counts`):
    count it, reopen every group at the first evaluation after the window (rule 3), and make
    the next collective of every closed group a head (rule 6). The first mark of a stronger
    kind than those seen so far starts the count again and reopens every group (rule 1). No
    collective runs."""
    global _WINDOW
    state = _WINDOW
    if 0 <= state.strongest < SOURCES[source]:  # rule 1: a stronger kind counts from here on
        state = _WINDOW = Window(
            depth=state.depth, counts=state.counts, checks=state.checks, digested=state.digested
        )
    state.strongest = SOURCES[source]
    closed = state.train_marks > window_iterations()
    state.marks += 1
    if kind == "train":
        state.train_marks += 1
    elif closed and not state.eval_seen:  # rule 3: the first evaluation after the window
        state.eval_seen = True
        state.reopened_at = state.marks
        state.closed.clear()
    state.heads = set(state.closed)


def take_digested() -> list[tuple[str, dist.ProcessGroup]]:
    """The groups the digest compares now, by name (rule 5); the next digest's are the groups
    closed now."""
    state = _WINDOW
    groups = sorted(state.digested.items())
    state.digested = dict(state.closed)
    return groups


def iterations_seen() -> tuple[int, int]:
    """(iterations begun of any kind, training iterations begun) since the windows restarted."""
    return _WINDOW.marks, _WINDOW.train_marks


def _backward_mark_due(state: Window) -> bool:
    """Rule 1's weakest mark: the first collective outside any backward after one inside."""
    if compat.current_graph_task_id() != -1:
        state.in_backward = True
        return False
    if state.in_backward:
        state.in_backward = False
        return True
    return False


def decide(group: dist.ProcessGroup | None) -> int:
    """What happens to the collective about to run on ``group`` (None: WORLD): :data:`CHECK`
    (agree first: check mode, or the group's window is open), :data:`FOLD` or :data:`HEAD`
    (after the window: record it; the head also agreed), :data:`SKIP` (mode off, a one-rank
    group), or :data:`MARK_FIRST` (a backward mark is due: mark, then ask again). Counts the
    checks (NOTE [ Check window ], rule 4)."""
    current = _SETTINGS.resolved if _SETTINGS.resolved is not None else mode()
    if current is CheckMode.OFF:
        return SKIP
    group = dist.group.WORLD if group is None else group
    if current is CheckMode.ALWAYS:
        return CHECK if dist.get_world_size(group) > 1 else SKIP
    state = _WINDOW
    if state.strongest <= 0 and _backward_mark_due(state):
        return MARK_FIRST
    key = group.group_name
    if key in state.closed:
        if key not in state.heads:
            return FOLD
        state.heads.discard(key)
        decision = HEAD
    elif dist.get_world_size(group) == 1:
        return SKIP
    elif state.marks == 0 and window_size() == 0:
        close_window(group)  # a window of no collectives: closed from the start, on every rank
        return FOLD
    else:
        decision = CHECK
        state.first_mark.setdefault(key, state.marks)
    state.counts[key] = state.counts.get(key, 0) + 1
    state.checks += 1
    return decision


def checked_count(group: dist.ProcessGroup | None) -> int:
    """How many collectives on ``group`` (None: WORLD) the window has agreed so far (heads
    after the window included)."""
    group = dist.group.WORLD if group is None else group
    return _WINDOW.counts.get(group.group_name, 0)


def windows_done() -> bool:
    """Whether this rank's window is over: the training iterations of the window have run
    (rule 1), or, before any iteration, :func:`window_size` checks were made in all groups
    together (rule 4)."""
    state = _WINDOW
    if state.marks == 0:
        return state.checks >= window_size()
    return state.train_marks > window_iterations() and state.marks > state.reopened_at


def group_window_done(group: dist.ProcessGroup | None) -> bool:
    """What this rank says of ``group``'s window in the group's next check (rule 2): over when
    :func:`windows_done` and, for a group first checked after the window or reopened by an
    evaluation iteration, once the next iteration has begun (rule 3)."""
    state = _WINDOW
    group = dist.group.WORLD if group is None else group
    key = group.group_name
    if state.marks == 0:  # rule 4: the counts, before any iteration
        return state.counts.get(key, 0) >= window_size() or windows_done()
    return windows_done() and state.marks > state.first_mark.get(key, 0)


def close_window(group: dist.ProcessGroup | None) -> None:
    """End ``group``'s window now (called on every member alike, after an agreement: rule 2);
    from now on its collectives go into the digest (rule 5)."""
    group = dist.group.WORLD if group is None else group
    name = group.group_name
    _WINDOW.closed[name] = group
    _WINDOW.digested[name] = group


def describe_settings() -> str:
    """The mode, window size and iteration count in force, as every rank must share them."""
    return f"{mode().value}, window {window_size()}, iterations {window_iterations()}"


def _describe() -> str:
    try:
        return describe_settings()
    except MegatronCoreError as exc:  # a bad environment value: shown, and raised on first use
        return f"invalid ({exc})"


# Every rank must run the same mode and window (NOTE [ Check window ], rule 8):
# initialize_model_parallel compares them over WORLD.
add_agreed_setting("consistency mode", _describe)
