"""The switch in the processes a program starts (private; used by ``install``/``uninstall``).

# NOTE [ Switch in every process ]
1. ``install()`` holds in the calling process and, from then on, in every child it starts with
   multiprocessing's "spawn" or "forkserver" method (``torch.multiprocessing``, DataLoader
   workers, ``torch.multiprocessing.spawn``): the first thing such a child unpickles is the
   parent's preparation data, and the switch rides in it, so the child installs the switch
   before it imports the parent's main module or unpickles the target and its arguments.
2. Why that early: megatron-core 0.19 replaces ``torch.storage._load_from_bytes`` when
   ``megatron.core`` is imported, so a tensor pickled after that imports megatron wherever it is
   unpickled; in a child that had not installed the switch yet, megatron-core's own
   parallel_state would load, and ``install()`` would then rightly refuse.
3. A "fork" child inherits ``sys.meta_path``, and so the switch, as it is.
4. A process that runs a program of its own (torchrun's workers, ``subprocess``) asks for the
   switch itself: ``install()`` at the top of the program, ``python -m megatron_core.megatron
   script.py``, or the pytest plugin. ``install()`` also sets ``MEGATRON_CORE_SWITCH=1`` in the
   environment, which those two honour, so a program that ran ``install()`` passes the request on.
5. ``uninstall()`` undoes 1 and 4 (4 only if ``install()`` set the variable).
6. A spawn/forkserver child turns the CPU mode (``cpu_mode.py``) on or off as the parent had it
   when it started the child; a program of its own decides by itself (rule 4).
"""

from __future__ import annotations

import multiprocessing.spawn
import os
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["arm", "disarm"]

_PREPARATION_KEY = "megatron_core_switch"  # ignored by multiprocessing's own prepare()
_ORIGINAL = multiprocessing.spawn.get_preparation_data


@dataclass
class _State:
    armed: bool = False  # children started now call install(cuda_on_cpu) first
    set_env: str | None = None  # the variable arm() set (disarm() removes it)
    install: Callable[[bool | None], object] | None = None  # the switch's install
    cuda_on_cpu: bool | None = None


_STATE = _State()


class _InstallInChild:
    """Unpickles as a call of the switch's ``install(cuda_on_cpu)`` (rules 1 and 6): pickle
    names the function by its module and name, so this module never imports the switch."""

    def __init__(self, install, cuda_on_cpu: bool | None):
        self.install = install
        self.cuda_on_cpu = cuda_on_cpu

    def __reduce__(self):
        return self.install, (self.cuda_on_cpu,)


def _get_preparation_data(name):
    data = _ORIGINAL(name)
    if _STATE.armed:
        data[_PREPARATION_KEY] = _InstallInChild(_STATE.install, _STATE.cuda_on_cpu)
    return data


def arm(env_name: str, install, cuda_on_cpu: bool | None = None) -> None:
    """Rules 1, 4 and 6: children started from now on call ``install(cuda_on_cpu)`` (the
    switch's own, a top-level function) before anything else."""
    multiprocessing.spawn.get_preparation_data = _get_preparation_data
    _STATE.armed = True
    _STATE.install = install
    _STATE.cuda_on_cpu = cuda_on_cpu
    if os.environ.get(env_name) is None:
        os.environ[env_name] = "1"
        _STATE.set_env = env_name


def disarm() -> None:
    """Rule 5."""
    _STATE.armed = False
    if multiprocessing.spawn.get_preparation_data is _get_preparation_data:
        multiprocessing.spawn.get_preparation_data = _ORIGINAL
    env_name = _STATE.set_env
    if env_name is not None:
        os.environ.pop(env_name, None)
        _STATE.set_env = None
