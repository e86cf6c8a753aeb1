"""Run a main job cleanly: a built-in launcher, one-line failures, Ctrl-C and a parent-death watch.

``scripts/train_gpt.py`` calls :func:`launch`. Started by hand (no ``RANK`` in the environment)
with ``--nproc-per-node N`` it is the launcher: it starts N copies of itself as ranks; started
by torchrun, or by this launcher, it is one rank.

# NOTE [ Clean exits ]
1. One line per failure. A user error (:class:`MegatronCoreError`: flags, layout, data,
   checkpoint) is raised alike on every rank (the package agrees before raising), so only global
   rank 0 prints it, as ``<prog>: error: <message>``, and every rank exits with status 1. Under
   another launcher (torchrun stops every rank once one exits) the other ranks wait to be
   stopped, so that rank 0 gets to print; one not stopped within 10 s prints its own line. The
   checks that need no peer run before the process group starts (``check_locally``): a rank
   that exits while a peer is still setting up its gloo connections would break them. An
   unexpected exception prints one line on the rank that raised it. ``--debug`` (or
   ``MEGATRON_CORE_DEBUG=1``) re-raises instead, with the Python traceback.
2. Ctrl-C / SIGTERM. The first signal raises ``KeyboardInterrupt`` at the next Python bytecode;
   later ones are ignored while the rank winds down. If that bytecode belongs to a finalizer
   (``weakref.finalize``, ``__del__``), Python swallows the exception and prints "Exception
   ignored"; the rank then hides that report and raises the interruption again in the main
   thread (``_thread.interrupt_main``, from a thread it starts; a second signal that arrives
   while that thread starts is left to it, not raised inside the hook). A peer blocked in a
   collective with a rank that already stopped gets a connection error, which counts as the
   same interruption. One line is printed (by the built-in launcher, else by rank 0); the
   status is 130 (SIGINT) or 143 (SIGTERM).
3. Parent-death watch. A rank started by a launcher (torchrun or ours) polls its parent pid
   twice a second; once the launcher is gone (SIGKILL leaves the ranks re-parented) the rank
   exits at once with status 1, so no rank trains on as an orphan. A rank whose collective fails
   because a peer's watch stopped it first reports the launcher's death too (rank 0, one line),
   not the connection error.
4. No teardown aborts. Every rank ends with ``os._exit`` after flushing its output: gloo's
   threads are never torn down by the interpreter's finalizers, which can abort
   (``terminate called without an active exception``) while a peer is still closing.
5. The launcher (:func:`_launch_ranks`) rendezvouses the ranks through a file, never a guessed
   port; when one rank fails it gives the others a few seconds to report, then terminates them,
   and exits with the first failing rank's status. It forwards SIGINT/SIGTERM to the ranks.
"""

from __future__ import annotations

import _thread
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence

from megatron_core import flags
from megatron_core.errors import MegatronCoreError

__all__ = ["RENDEZVOUS_ENV", "LAUNCHER_PID_ENV", "DEBUG_ENV", "launch", "debug_requested"]

RENDEZVOUS_ENV = "MEGATRON_CORE_RENDEZVOUS"  # file:// rendezvous of the built-in launcher
LAUNCHER_PID_ENV = "MEGATRON_CORE_LAUNCHER_PID"
DEBUG_ENV = "MEGATRON_CORE_DEBUG"
_GRACE_S = 5.0  # a rank's time to report after a peer failed or a signal arrived
_WATCH_INTERVAL_S = 0.5


def debug_requested(argv: Sequence[str]) -> bool:
    """True if ``--debug`` is in ``argv`` or ``MEGATRON_CORE_DEBUG`` is set to a true value."""
    return "--debug" in argv or flags.flag(DEBUG_ENV) is True


def _global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _say(prog: str, text: str) -> None:
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


_TEMPORARY_DIRS: list[str] = []


def temporary_directory(prefix: str) -> str:
    """A new directory under the system's temporary folder, removed when the process exits
    (also through :func:`_exit`, which skips ``atexit``): a rendezvous store's file (the
    launcher's, or one process's) lives there until then."""
    path = tempfile.mkdtemp(prefix=prefix)
    if not _TEMPORARY_DIRS:
        atexit.register(_remove_temporary_dirs)
    _TEMPORARY_DIRS.append(path)
    return path


def _remove_temporary_dirs() -> None:
    while _TEMPORARY_DIRS:
        shutil.rmtree(_TEMPORARY_DIRS.pop(), ignore_errors=True)


def _exit(status: int) -> None:
    """See NOTE [ Clean exits ], rule 4."""
    _remove_temporary_dirs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_REINTERRUPT_DELAY_S = 0.05  # NOTE [ Clean exits ], rule 2: after the finalizer returned


class _Signals:
    """Turns the first SIGINT/SIGTERM into KeyboardInterrupt; see NOTE [ Clean exits ], rule 2."""

    def __init__(self):
        self.received: int | None = None
        self.swallowed = False  # the KeyboardInterrupt was raised inside a finalizer and lost
        self._retrying = False  # the unraisable hook is starting the thread that raises it again
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable

    def _handle(self, signum, frame) -> None:
        if self._retrying:  # a second signal inside the hook: the retry thread will raise it
            return
        if self.received is None or self.swallowed:
            self.received = self.received or signum
            self.swallowed = False
            raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        kind = unraisable.exc_type
        if not (kind is not None and issubclass(kind, KeyboardInterrupt) and self.received):
            self._previous_hook(unraisable)
            return
        self.swallowed = True  # raise it again in the main thread, once the finalizer is over
        self._retrying = True
        try:
            threading.Thread(target=_interrupt_main_soon, daemon=True).start()
        finally:
            self._retrying = False


def _interrupt_main_soon() -> None:
    time.sleep(_REINTERRUPT_DELAY_S)
    _thread.interrupt_main()


def _watch_parent(prog: str) -> int | None:
    """See NOTE [ Clean exits ], rule 3. Only under a launcher: a rank started from a shell keeps
    running when the shell exits (nohup). Returns the launcher's pid (None: not watched)."""
    if not (os.environ.get(LAUNCHER_PID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID")):
        return None
    # Our launcher names itself: the rank may have been orphaned while importing torch.
    parent = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())

    def watch() -> None:
        while True:
            if _launcher_died(parent):
                _stop_orphan(prog, parent)
            time.sleep(_WATCH_INTERVAL_S)

    threading.Thread(target=watch, name="parent-death-watch", daemon=True).start()
    return parent


def _launcher_died(parent: int | None) -> bool:
    return parent is not None and (os.getppid() != parent or parent == 1)


def _stop_orphan(prog: str, parent: int) -> None:
    if _global_rank() == 0:
        _say(prog, f"the launcher (pid {parent}) died; stopping")
    _exit(1)


_PEER_REPORT_WAIT_S = 2 * _GRACE_S


def _leave_the_report_to_rank0(prog: str, rank: int, exc: BaseException, signals) -> None:
    """NOTE [ Clean exits ], rule 1, under another launcher (torchrun): rank 0 prints a user
    error, but torchrun stops every rank as soon as one exits, so a rank that exited first could
    stop rank 0 before it printed. This rank waits to be stopped instead; if nobody stops it (the
    error was this rank's alone, or the launcher lets ranks run on), it prints the line itself."""
    try:
        time.sleep(_PEER_REPORT_WAIT_S)
    except KeyboardInterrupt:  # the launcher's SIGTERM, once rank 0 exited
        _exit(128 + (signals.received or signal.SIGINT))
    _say(prog, f"error on rank {rank}: {exc}")


def _run_rank(prog: str, main: Callable[[], int], debug: bool) -> None:
    """Run ``main`` as one rank and exit the process with NOTE [ Clean exits ]' rules."""
    signals = _Signals()
    parent = _watch_parent(prog)
    warnings.formatwarning = lambda message, *_, **__: f"{prog}: warning: {message}\n"
    rank = _global_rank()
    try:
        status = main()
    except BaseException as exc:  # sorted below; nothing escapes with a traceback unless debug
        if signals.received is not None or isinstance(exc, KeyboardInterrupt):
            if rank == 0 and not os.environ.get(LAUNCHER_PID_ENV):  # else the launcher says it
                name = signal.Signals(signals.received or signal.SIGINT).name
                _say(prog, f"interrupted ({name}); stopped")
            _exit(128 + (signals.received or signal.SIGINT))
        if isinstance(exc, SystemExit):
            _exit(exc.code if isinstance(exc.code, int) else 1)
        if _launcher_died(parent):  # a peer stopped by its watch first broke our collective
            _stop_orphan(prog, parent)
        if debug:
            traceback.print_exc()
            _exit(1)
        if isinstance(exc, MegatronCoreError):
            if rank == 0:
                _say(prog, f"error: {exc}")
            elif not os.environ.get(LAUNCHER_PID_ENV):
                _leave_the_report_to_rank0(prog, rank, exc, signals)
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _say(
                prog,
                f"error on rank {rank}: {type(exc).__name__}: {first} (--debug shows "
                "the traceback)",
            )
        _exit(1)
    _exit(status)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _launch_ranks(prog: str, script: str, argv: Sequence[str], nproc: int) -> int:
    """Start ``nproc`` ranks of ``script`` and wait; see NOTE [ Clean exits ], rule 5."""
    rendezvous_dir = temporary_directory("megatron_core_launch_")  # removed by _exit
    env = {
        **os.environ,
        RENDEZVOUS_ENV: f"file://{os.path.join(rendezvous_dir, 'rendezvous')}",
        LAUNCHER_PID_ENV: str(os.getpid()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    ranks = [
        subprocess.Popen(
            [sys.executable, script, *argv],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            # A rank ignores Ctrl-C until _Signals is installed (a KeyboardInterrupt while it
            # imports torch would print a traceback); this launcher then stops it (rule 5).
            preexec_fn=_ignore_sigint,
        )
        for r in range(nproc)
    ]
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    status, deadline = 0, None
    while any(p.poll() is None for p in ranks):
        failed = [p.returncode for p in ranks if p.returncode not in (None, 0)]
        if (failed or received) and deadline is None:
            status = failed[0] if failed else 128 + received[0]
            deadline = time.monotonic() + _GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    if not status:
        status = next((p.returncode for p in ranks if p.returncode), 0)
    if status < 0:  # a rank killed by a signal
        status = 128 - status
    if received:
        _say(prog, f"interrupted ({signal.Signals(received[0]).name}); stopped")
    return status


def launch(
    prog: str,
    script: str,
    argv: Sequence[str],
    nproc_per_node: Callable[[Sequence[str]], int],
    main: Callable[[], int],
) -> None:
    """Run a main job as the launcher or as one rank, and exit the process.

    Args:
        prog: the program name for messages (``train_gpt.py``).
        script: the script's path; the launcher runs it once per rank.
        argv: the command-line arguments (without the program).
        nproc_per_node: reads the rank count from ``argv``; may raise MegatronCoreError.
        main: one rank's work (parses ``argv`` itself); returns the exit status.

    Never returns: the process exits with the status of NOTE [ Clean exits ].
    """
    debug = debug_requested(argv)
    if "RANK" in os.environ:
        _run_rank(prog, main, debug)
    try:
        nproc = nproc_per_node(argv)
    except MegatronCoreError as exc:
        if debug:
            raise
        _say(prog, f"error: {exc}")
        _exit(2)
    if nproc == 1:
        _run_rank(prog, main, debug)
    _exit(_launch_ranks(prog, script, argv, nproc))
