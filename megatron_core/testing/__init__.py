"""Multi-rank test harness: run a function on N gloo ranks in spawned processes.

The face of the harness; how it works (forkserver workers, file rendezvous, warm pools, the state
every call starts from, failures and timeouts) is the docstring of harness.py. One idea a module:

- harness.py: the public entry points (check the call, hand it to the pools, return the results).
- pools.py: the caller side: warm worker processes (start, reuse, stop), tasks out and replies
  back, and the errors a failed or late rank turns into.
- worker.py: the rank side: the loop each worker process runs, the state reset after each task,
  and the device mode both sides read.
- protocol.py: the messages between the two sides (a Task out, a Reply back, STOP).
- pickling.py: how arguments and results are pickled (tensors' storages by value).
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
