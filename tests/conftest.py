"""Shared pytest set-up: the multi-rank harness as a fixture, and pool shutdown at session end."""

import pytest

from megatron_core.testing import run_distributed, shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _distributed_worker_pools():
    """Stop the warm worker pools of megatron_core.testing when the session ends."""
    yield
    shutdown_pools()


@pytest.fixture
def distributed():
    """``run_distributed(fn, world_size, *args, timeout=120.0, **kwargs)``: run ``fn`` on gloo
    ranks in worker processes and return each rank's result (see megatron_core.testing)."""
    return run_distributed
