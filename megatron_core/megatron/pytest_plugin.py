"""pytest plugin: run a megatron-core test suite on this package, on gloo CPU ranks, with one flag.

Installed as a ``pytest11`` entry point, so pytest always loads it; it does nothing unless asked::

    torchrun --nproc-per-node 8 -m pytest --megatron-core-switch tests/unit_tests/tensor_parallel
    MEGATRON_CORE_SWITCH=1 torchrun --nproc-per-node 8 -m pytest tests/unit_tests/...

(``-p megatron_core.megatron.pytest_plugin`` loads it where entry points are disabled.) Asked, it
installs the switch (megatron_core.megatron.install) before any conftest imports megatron, so the
suite's ``megatron.core.parallel_state`` etc. are this package's. When torch has no CUDA that
turns on the switch's CPU mode (cpu_mode.py, NOTE [ CUDA on the CPU ]): the suite's CUDA-only
set-up runs on CPU ranks (a process group requested with "nccl" is gloo, ``torch.cuda.set_device``
does nothing, ``torch.cuda.device_count()`` is the number of local ranks, ...). The CPU mode is
turned off at the end of the session. Under torchrun the ranks wait for each other after every
test, so a test that fails on one rank alone ends the session instead of hanging it
(NOTE [ Ranks out of step in a test session ] in ``_rank_steps.py``).

megatron-core's unit-test conftest asks ``is_te_min_version`` before every test, which
megatron-core 0.16.1 cannot answer without Transformer Engine: with the switch the Transformer
Engine stand-in answers it (its version; NOTE [ Serving the Transformer Engine stand-in ]; where
no ``transformer_engine`` is importable at all the switch's adapter does: NOTE [ Without
Transformer Engine ], rule 5, in without_te.py). ``is_fa_min_version``, which some test files ask
at collection, answers False without flash-attn (rule 8), and the plugin gives the originals
back at the end of the session (rule 6).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_core.megatron._rank_steps import DEFAULT_TIMEOUT_S, RankSteps

SWITCH_FLAG = "--megatron-core-switch"
STEP_TIMEOUT_FLAG = "--megatron-core-step-timeout"


@dataclass
class _Session:
    installed: bool = False  # this plugin installed the switch
    steps: RankSteps | None = None  # NOTE [ Ranks out of step in a test session ]


_STATE = _Session()


def pytest_addoption(parser) -> None:
    """pytest hook: the ``--megatron-core-switch`` and ``--megatron-core-step-timeout`` flags."""
    group = parser.getgroup("megatron_core")
    group.addoption(
        SWITCH_FLAG,
        action="store_true",
        default=False,
        help="serve megatron.core's parallel_state / tensor_parallel / pipeline_parallel / "
        "configs / finalize_model_grads from megatron_core, on gloo CPU ranks without CUDA "
        "(also: MEGATRON_CORE_SWITCH=1)",
    )
    group.addoption(
        STEP_TIMEOUT_FLAG,
        type=float,
        default=None,
        metavar="SECONDS",
        help="with the switch under torchrun: how long a rank that finished a test waits for "
        "the others to finish it before it ends the session (ranks out of step; default: "
        f"pytest-timeout's --timeout where set, else {DEFAULT_TIMEOUT_S:g})",
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

    megatron.install()  # sets MEGATRON_CORE_SWITCH=1 for the processes the suite starts
    _STATE.installed = True


def pytest_configure(config) -> None:
    """With the switch installed under torchrun: the steps of NOTE [ Ranks out of step in a
    test session ]."""
    if _STATE.installed:
        timeout_s = config.getoption("megatron_core_step_timeout")
        if timeout_s is None:  # pytest-timeout's limit per test, where one is set
            timeout_s = _pytest_timeout(config) or DEFAULT_TIMEOUT_S
        if not timeout_s > 0:
            raise ValueError(f"{STEP_TIMEOUT_FLAG} must be a positive number, got {timeout_s}")
        _STATE.steps = RankSteps.from_environment(timeout_s)


def _pytest_timeout(config) -> float | None:
    """pytest-timeout's ``--timeout`` (or its ini setting), if that plugin is there and set."""
    try:
        value = config.getoption("timeout")
    except ValueError:  # pytest-timeout is not installed
        return None
    if value is None:
        try:
            value = config.getini("timeout")
        except ValueError:
            return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


def pytest_runtest_logreport(report) -> None:
    """pytest hook: a failed phase of a test is kept, to be printed if ranks fall out of step
    (the session's own summary is not printed then)."""
    if _STATE.steps is not None and report.failed:
        _STATE.steps.failures.append(f"{report.nodeid} ({report.when}):\n{report.longreprtext}")


def pytest_runtest_logfinish(nodeid, location) -> None:
    """After a test's teardown, every rank waits for the others to finish it (rule 2)."""
    if _STATE.steps is not None:
        _STATE.steps.after_test(nodeid)


def pytest_unconfigure(config) -> None:
    """Put megatron-core's ``is_te_min_version`` back and turn the CPU mode off again (only
    where this plugin installed the switch)."""
    _STATE.steps = None
    if _STATE.installed:
        _STATE.installed = False
        from megatron_core.megatron import cpu_mode, without_te

        without_te.put_back()  # NOTE [ Without Transformer Engine ], rule 6
        cpu_mode.disable()
