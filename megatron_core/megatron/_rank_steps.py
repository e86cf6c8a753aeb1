"""Keeps the ranks of a torchrun-launched pytest session in step, test by test, or ends it.

# NOTE [ Ranks out of step in a test session ]
1. A multi-rank suite (megatron-core's own unit tests, ``torchrun --nproc-per-node 8 -m pytest``)
   runs every test on every rank, and a test's collectives pair up across ranks in the order
   each rank reaches them. A test that fails on one rank alone (an assertion before a barrier
   its peers are in; a race in the test between one rank's file removal and another's listing)
   leaves that rank one collective ahead or behind. From then on every collective of the
   session pairs the wrong calls: on NCCL this surfaces as an error or a watchdog timeout; on
   gloo the ranks wait forever (gloo's default timeout is 30 minutes per collective, and
   pytest-timeout's signal cannot interrupt a wait inside gloo's C++ code).
2. So, with the switch asked for and more than one rank, every rank stops after each test
   (after its teardown) at a step: it writes the test's id under the step's number into the
   torchrun agent's key-value store (the one ``init_process_group``'s ``env://`` rendezvous
   already uses; keys under ``megatron_core_pytest/<run id>/<restart>/``) and waits until every
   rank has written the same step. The store is not the process group, so a rank stuck in a
   collective cannot make the step wait for a collective.
3. All ranks at the step with the same test id: the session goes on (a few store round trips
   per test). Different test ids (the ranks collected different tests): every rank stops, naming
   what each rank ran. A rank not there within the limit (``--megatron-core-step-timeout``;
   by default pytest-timeout's ``--timeout`` where set, else 300 s): the waiting rank prints
   which ranks are missing and which test it last finished, and leaves with status 1;
   torchrun then stops the others, as it does when any rank fails. A hang becomes one clear
   failure; the tests after it do not run.
4. Outside torchrun (no agent store in the environment), or on one rank, nothing is done.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

DEFAULT_TIMEOUT_S = 300.0
_POLL_S = (0.002, 0.1)  # first and longest sleep between looks at the store


class RankSteps:
    """The step of NOTE [ Ranks out of step in a test session ] for one rank's session."""

    def __init__(self, store, rank: int, world_size: int, prefix: str, timeout_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.timeout_s = prefix, timeout_s
        self.step = 0
        self.failures: list[str] = []  # this rank's failure reports, printed when it leaves

    @classmethod
    def from_environment(cls, timeout_s: float) -> RankSteps | None:
        """The steps of this torchrun rank (None outside torchrun or on one rank; rule 4)."""
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        if world_size <= 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        import torch.distributed as dist

        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=max(timeout_s, 30.0)),
        )
        run = env.get("TORCHELASTIC_RUN_ID", "none")
        prefix = f"megatron_core_pytest/{run}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        return cls(store, int(env["RANK"]), world_size, prefix, timeout_s)

    def _key(self, step: int, rank: int) -> str:
        return f"{self.prefix}{step}/{rank}"

    def after_test(self, nodeid: str) -> None:
        """Rule 2-3: wait for every rank to finish ``nodeid`` as this rank's next step."""
        step, self.step = self.step, self.step + 1
        self.store.set(self._key(step, self.rank), nodeid)
        keys = [self._key(step, r) for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_S[0]
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
                self._leave(
                    f"rank(s) {missing} did not finish test {step + 1} of the session within "
                    f"{self.timeout_s:g} s after rank {self.rank} finished it ({nodeid}); they "
                    "most likely wait in a collective that a rank skipped when the test failed "
                    "on it alone, so the ranks' collectives are out of step. Stopping this "
                    "rank (torchrun stops the others) instead of waiting forever "
                    "(--megatron-core-step-timeout sets the limit)"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
        ran = [self.store.get(key).decode() for key in keys]
        if any(other != nodeid for other in ran):
            listing = "; ".join(f"rank {r}: {t}" for r, t in enumerate(ran))
            self._leave(
                f"the ranks ran different tests as test {step + 1} of the session ({listing}); "
                "every rank must collect the same tests in the same order"
            )

    def _leave(self, message: str) -> None:
        sys.stdout.flush()
        for report in self.failures[-3:]:  # the session's summary will not be printed
            sys.stderr.write(f"\n{report}\n")
        sys.stderr.write(f"\nmegatron_core pytest plugin: {message}\n")
        sys.stderr.flush()
        os._exit(1)
