"""Safe after the check window: the disagreements of _late_cases.py, run after three marked
iterations in the default mode, never return a wrong result silently (NOTE [ Check window ],
rules 5-7).

Each case runs at TP 2 as the fourth iteration's first collective on the TP group ("head": it
is agreed before it runs) and after an agreeing one ("mid": recorded, then compared by the
iteration's digest). Every outcome is asserted exactly (``_late_cases.expected``): an error on
every rank, the same message; where the rank that differs raises alone or every rank waits, a
timeout names the collective. The cases that make gloo abort the process in the mid position
(``_late_cases.ABORTS``, each with its sizes) are left out here: they would kill the workers;
``scripts/checks/check_disagreement_after_window.py`` counts them, before and after.
"""

from __future__ import annotations

import _late_cases as cases
import pytest

from megatron_core.testing import run_distributed, shutdown_pools

_RUN = [  # a case whose head ends as its mid does (the same check catches both) runs once
    (name, position)
    for name in cases.CASES
    for position in ("head", "mid")
    if cases.expected(name, position) != "abort"
    and not (position == "head" and cases.expected(name, "head") == cases.expected(name, "mid"))
]


def test_the_case_lists_are_cases():
    listed = {*cases.SOME_RANKS, *cases.NAMED_WAITS, *cases.ABORTS, *cases.DIGEST}
    assert listed <= set(cases.CASES)
    assert {name for name, _ in _RUN} == set(cases.CASES)  # every case runs, one way or two


@pytest.mark.parametrize("name, position", _RUN)
def test_a_disagreement_after_the_window_is_never_silent(name, position):
    want = cases.expected(name, position)
    results = run_distributed(cases.run_case, 2, name, position, "default", 2, timeout=60)
    got = cases.classify(results)
    if not got.startswith("every rank"):
        shutdown_pools()  # a group a timeout broke: the next case gets fresh workers
    assert got != "silent", f"{name} ({position}) returned on every rank: {results}"
    assert got == want, f"{name} ({position}): {got}, not {want}: {results}"
    if want.startswith("every rank"):
        message = results[0][3]
        assert (
            "global ranks [0, 1]" in message
            or "outside [0" in message
            or (
                "dtype torch.float64 is not the layer's" in message
                or "is not divisible by the group size" in message
            )
        ), message
    if want == "every rank (digest)":
        assert "collective #" in results[0][3] and "differs" in results[0][3], results[0][3]
