"""Multi-rank test harness: run a function on N gloo ranks in spawned processes.

The face of the harness; how it works (forkserver workers, file rendezvous, warm pools, the state
every call starts from, failures and timeouts) is the docstring of harness.py, the worker loop
each rank runs is worker.py.
"""

from megatron_core.testing.harness import (
    NO_REUSE_ENV,
    RESET_SEED,
    START_METHOD_ENV,
    DistributedTestError,
    DistributedTestTimeout,
    RankFailure,
    distributed_test,
    run_distributed,
    shutdown_pools,
)

__all__ = [
    # harness.py
    "DistributedTestError",
    "DistributedTestTimeout",
    "RankFailure",
    "run_distributed",
    "distributed_test",
    "shutdown_pools",
    "RESET_SEED",
    "NO_REUSE_ENV",
    "START_METHOD_ENV",
]
