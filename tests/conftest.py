"""Shared pytest set-up: the multi-rank harness as a fixture, and pool shutdown at session end.

tests/ mirrors the package, a folder per family (parallel_state/, tensor_parallel/ with
recompute/, pipeline_parallel/, ...); tests of the top-level modules (device, compat, errors, the
import graph, the support matrix) sit here. The rank bodies that several folders share are helper
modules of the folder they belong to (``_megatron_gpt`` and ``_megatron_ddp`` in megatron/,
``_train_args`` in training/): those folders go on ``sys.path`` here, so a test anywhere imports
them by name, and the harness hands the same path to its worker processes.

The suite runs in check mode (megatron_core.consistency): every collective first
verifies that the ranks agree. Set before any worker starts, so every worker inherits it;
``MEGATRON_CORE_CHECK_CONSISTENCY=0 python -m pytest tests -q`` runs without it. Tests of the
default mode (the check window) force it in their per-rank bodies
(``consistency.check_mode("window")``) and assert that it is in force.

``@pytest.mark.requires_megatron_core`` is the one way a test says it needs megatron-core (the
``[megatron]`` extra): without it the test is skipped with that reason.
"""

import os
import sys

import pytest

from megatron_core import consistency
from megatron_core.megatron import megatron_core_version
from megatron_core.tensor_parallel.random import keep_device_stream_apart
from megatron_core.testing import run_distributed, shutdown_pools

os.environ.setdefault(consistency.CHECK_ENV, "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
for _helpers in ("megatron", "training"):
    if os.path.join(_HERE, _helpers) not in sys.path:
        sys.path.insert(0, os.path.join(_HERE, _helpers))


MEGATRON_CORE_MISSING = "megatron-core is not installed (the [megatron] extra)"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_megatron_core: skipped where megatron-core is not installed"
    )


def pytest_runtest_setup(item):
    if item.get_closest_marker("requires_megatron_core") and megatron_core_version() is None:
        pytest.skip(MEGATRON_CORE_MISSING)


@pytest.fixture(scope="session", autouse=True)
def _distributed_worker_pools():
    """Stop the warm worker pools of megatron_core.testing when the session ends."""
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def _cpu_device_stream_as_found():
    """Each test starts with the CPU generator serving device draws too, as the harness's
    workers do (a test that seeds with model_parallel_cuda_manual_seed keeps the device stream
    apart for itself only: NOTE [ RNG streams ], rule 6)."""
    keep_device_stream_apart(False)
    yield
    keep_device_stream_apart(False)


@pytest.fixture
def distributed():
    """``run_distributed(fn, world_size, *args, timeout=120.0, **kwargs)``: run ``fn`` on gloo
    ranks in worker processes and return each rank's result (see megatron_core.testing)."""
    return run_distributed
