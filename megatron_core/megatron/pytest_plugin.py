"""pytest plugin: run a megatron-core test suite on this package, on gloo CPU ranks, with one flag.

Installed as a ``pytest11`` entry point, so pytest always loads it; it does nothing unless asked::

    torchrun --nproc-per-node 8 -m pytest --megatron-core-switch tests/unit_tests/tensor_parallel
    MEGATRON_CORE_SWITCH=1 torchrun --nproc-per-node 8 -m pytest tests/unit_tests/...

(``-p megatron_core.megatron.pytest_plugin`` loads it where entry points are disabled.) Asked, it
installs the switch (megatron_core.megatron.install) before any conftest imports megatron, so the
suite's ``megatron.core.parallel_state`` etc. are this package's. When torch has no CUDA that
turns on the switch's CPU mode (cpu_mode.py, NOTE [ CUDA on the CPU ]): the suite's CUDA-only
set-up runs on CPU ranks (a process group requested with "nccl" is gloo, ``torch.cuda.set_device``
does nothing, ...). The CPU mode is turned off at the end of the session.
"""

from __future__ import annotations

import os

SWITCH_FLAG = "--megatron-core-switch"
_STATE = {"installed": False}


def pytest_addoption(parser) -> None:
    group = parser.getgroup("megatron_core")
    group.addoption(
        SWITCH_FLAG,
        action="store_true",
        default=False,
        help="serve megatron.core's parallel_state / tensor_parallel / pipeline_parallel / "
        "configs / finalize_model_grads from megatron_core, on gloo CPU ranks without CUDA "
        "(also: MEGATRON_CORE_SWITCH=1)",
    )


def _asked(early_config) -> bool:
    from megatron_core.megatron import SWITCH_ENV, _env_on

    # Before the conftests load, only the pre-parsed arguments are there.
    if getattr(early_config.known_args_namespace, "megatron_core_switch", False):
        return True
    return _env_on(SWITCH_ENV)


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Install before the suite's conftest files import megatron."""
    if not _asked(early_config):
        return
    from megatron_core import megatron

    os.environ[megatron.SWITCH_ENV] = "1"  # processes the suite spawns install it too
    megatron.install()
    _STATE["installed"] = True


def pytest_unconfigure(config) -> None:
    """Turn the CPU mode off again (only where this plugin installed the switch)."""
    if _STATE["installed"]:
        _STATE["installed"] = False
        from megatron_core.megatron import cpu_mode

        cpu_mode.disable()
