"""The switch of the consistency checks: which collectives are agreed before they run.

Three modes (:class:`CheckMode`); NOTE [ Check window ] says how the default one stays safe.

* ``WINDOW``, the default: the collectives of the first training iterations are agreed (shapes,
  dtypes, arguments, contents where they must be equal), then none. An iteration is what the
  package sees of one: a pipeline schedule's ``forward_backward_func`` call, or, for a loop
  without one, a ``finalize_model_grads`` call. Two iterations by default
  (:func:`window_iterations`, ``MEGATRON_CORE_CHECK_ITERATIONS``), where disagreements start: a
  batch cut differently, a vocabulary split computed locally, a shape off by one. Before any
  iteration is seen, a count of collectives per group stands in (:func:`window_size`, default
  4096, ``MEGATRON_CORE_CHECK_WINDOW``).
* ``ALWAYS`` (check mode): every collective is agreed. ``MEGATRON_CORE_CHECK_CONSISTENCY=1``,
  :func:`set_mode` / :func:`check_mode`, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
* ``OFF``: nothing is agreed (megatron-core's behaviour: a disagreement hangs, aborts in gloo or
  gives wrong numbers). ``MEGATRON_CORE_CHECK_CONSISTENCY=0`` or ``set_mode("off")``.

# NOTE [ Check window ]
1. Iterations. :func:`iteration` (a context manager) marks one: the schedules wrap each
   ``forward_backward_func`` call in it (``kind="eval"`` when ``forward_only``), and so does the
   main job's step. Where no such block is seen, a loop's own once-a-step calls mark them:
   ``finalize_model_grads``, else a torch optimizer's ``step`` (a global step hook); a kind of
   mark counts only while no stronger one has been seen (block > finalize > optimizer step), and
   a mark inside a block counts nothing. Training iterations 1..I are agreed whole -- their
   forward, backward, gradient reductions and the optimizer's collectives after the schedule
   returns -- and the window closes when iteration I + 1 begins.
2. Closing is decided in an agreement, never alone: a rank whose window is over says so in the
   next check on each group (a slot of the exchanged table, not compared), and the group closes
   after that check on every member at once (NOTE [ Agree before acting ], rule 2). So no member
   is ever in a check while another is in the collective it guards, even where the ranks
   counted iterations differently, and the first collective that differs between the ranks is,
   inside the window, caught by its check.
3. What stays open after the window: a group whose first check comes after the window closed
   (a group created later) is agreed until the next iteration begins; the first evaluation
   iteration (``kind="eval"``) after the window reopens every group for that iteration. After
   that, only local checks that need no peer run (token ids inside the vocabulary:
   :func:`~megatron_core.consistency.check_ids`); what is not covered is a disagreement that
   first appears in a later iteration (a data-dependent shape at iteration 1000): check mode
   finds those.
4. Fallback before any iteration is seen (a program that marks none): one counter per process
   group, keyed by the group's name (the same on every member), counts the checks made on it; a
   member whose count reached ``N`` = :func:`window_size`, or that has made ``N`` checks in all
   groups together (a group with rare collectives would otherwise stay open for ``N``
   iterations), says the window is over in its next check on the group (rule 2).
5. Every rank must run the same mode, window size and iteration count; each agreement compares
   them (a difference raises at ``initialize_model_parallel``). Setting any of them (every rank
   alike) restarts every window and the iteration count.
6. Outside the window nothing is exchanged: the cost is a dictionary lookup per collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Iterator

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatron_core import flags
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
    "iteration",
    "note_iteration",
    "iterations_seen",
    "should_check",
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
class _Window:
    """Where the windows stand (NOTE [ Check window ]); reset by every setting change."""

    checks: int = 0  # checks made in all groups together (rule 4)
    marks: int = 0  # iterations begun, of any kind (rule 1)
    train_marks: int = 0  # training iterations begun
    eval_seen: bool = False  # an evaluation iteration has begun since the window closed
    reopened_at: int = -1  # ``marks`` when the first evaluation iteration reopened the groups
    depth: int = 0  # nesting of iteration() blocks: only the outermost counts
    strongest: int = -1  # the strongest kind of mark seen (rule 1: _SOURCES)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # group name -> checks
    first_mark: dict[str, int] = dataclasses.field(default_factory=dict)  # group -> marks then
    closed: set[str] = dataclasses.field(default_factory=set)  # groups closed in an agreement


_SOURCES = {"optimizer": 0, "finalize": 1, "block": 2}  # rule 1: weakest to strongest
_SETTINGS = _Settings()
_WINDOW = _Window()


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
    environment again; restarts every group's window (NOTE [ Check window ], rule 5) unless
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
    _WINDOW = _Window(depth=depth)


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    """torch's global optimizer step hook: a once-a-step mark of the weakest kind (rule 1)."""
    note_iteration("optimizer")


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


@contextlib.contextmanager
def iteration(kind: str = "train") -> Iterator[None]:
    """Mark the block as one iteration of ``kind`` ("train" or "eval") for the check window
    (NOTE [ Check window ], rule 1); a block inside another counts nothing. Every rank must mark
    the same iterations. No collective runs."""
    if kind not in ("train", "eval"):
        raise MegatronCoreError(f"iteration: kind ({kind!r}) must be 'train' or 'eval'")
    if _WINDOW.depth == 0:
        _mark("block", kind)
    _WINDOW.depth += 1
    try:
        yield
    finally:
        _WINDOW.depth -= 1  # the current state: a restart inside the block keeps the depth


def note_iteration(source: str = "finalize") -> None:
    """A training iteration seen by a function that runs once a step (``"finalize"``:
    ``finalize_model_grads``; ``"optimizer"``: a torch optimizer's step): counts outside
    :func:`iteration` blocks, while no stronger kind of mark has been seen (rule 1)."""
    if source not in ("finalize", "optimizer"):
        raise MegatronCoreError(f"note_iteration: source ({source!r}) is not finalize/optimizer")
    if _WINDOW.depth == 0:
        _mark(source, "train")


def _mark(source: str, kind: str) -> None:
    state = _WINDOW
    strength = _SOURCES[source]
    if strength < state.strongest:
        return
    state.strongest = strength
    closed = state.train_marks > window_iterations()
    state.marks += 1
    if kind == "train":
        state.train_marks += 1
    elif closed and not state.eval_seen:  # rule 3: the first evaluation after the window
        state.eval_seen = True
        state.reopened_at = state.marks
        state.closed.clear()


def iterations_seen() -> tuple[int, int]:
    """(iterations begun of any kind, training iterations begun) since the windows restarted."""
    return _WINDOW.marks, _WINDOW.train_marks


def should_check(group: dist.ProcessGroup | None) -> bool:
    """Whether the collective about to run on ``group`` (None: WORLD) is agreed first: always
    in check mode, never when off, and in ``WINDOW`` mode while the group's window is open
    (NOTE [ Check window ]). Never for a one-rank group."""
    current = _SETTINGS.resolved if _SETTINGS.resolved is not None else mode()
    if current is CheckMode.OFF:
        return False
    group = dist.group.WORLD if group is None else group
    if current is CheckMode.ALWAYS:
        return dist.get_world_size(group) > 1
    state = _WINDOW
    key = group.group_name
    if key in state.closed or dist.get_world_size(group) == 1:
        return False
    if state.marks == 0 and window_size() == 0:
        return False  # a window of no collectives: closed from the start, on every rank
    state.counts[key] = state.counts.get(key, 0) + 1
    state.first_mark.setdefault(key, state.marks)
    state.checks += 1
    return True


def checked_count(group: dist.ProcessGroup | None) -> int:
    """How many collectives on ``group`` (None: WORLD) the window has agreed so far."""
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
    """End ``group``'s window now (called on every member alike, after an agreement: rule 2)."""
    group = dist.group.WORLD if group is None else group
    _WINDOW.closed.add(group.group_name)


def describe_settings() -> str:
    """The mode, window size and iteration count in force, as every rank must share them."""
    return f"{mode().value}, window {window_size()}, iterations {window_iterations()}"


def _describe() -> str:
    try:
        return describe_settings()
    except MegatronCoreError as exc:  # a bad environment value: shown, and raised on first use
        return f"invalid ({exc})"


# Every rank must run the same mode and window (NOTE [ Check window ], rule 5):
# initialize_model_parallel compares them over WORLD.
add_agreed_setting("consistency mode", _describe)
register_optimizer_step_post_hook(_optimizer_stepped)
