"""Multi-rank test harness: run a function on N gloo ranks in spawned processes.

The face of the harness; how it works (forkserver workers, file rendezvous, warm pools, the state
every call starts from, failures and timeouts) is the docstring of harness.py, the worker loop
each rank runs is worker.py, the pools of warm workers pools.py.
"""

from megatron_core.testing.harness import distributed_test, run_distributed
from megatron_core.testing.pools import (
    NO_REUSE_ENV,
    START_METHOD_ENV,
    DistributedTestError,
    DistributedTestTimeout,
    RankFailure,
    shutdown_pools,
)
from megatron_core.testing.worker import RESET_SEED, shares_gpus

__all__ = [
    # harness.py
    "run_distributed",
    "distributed_test",
    # pools.py
    "DistributedTestError",
    "DistributedTestTimeout",
    "RankFailure",
    "shutdown_pools",
    "NO_REUSE_ENV",
    "START_METHOD_ENV",
    # worker.py
    "RESET_SEED",
    "shares_gpus",
]
