"""What each disagreement of tests/consistency/_late_cases.py ends in after the check window.

Every case runs on ``--tp`` gloo ranks after three marked training iterations (the default
window has closed), inside a fourth: as the iteration's first collective on the TP group
("head") and after an agreeing one ("mid"); in the default mode and with every check off ("off":
what the package did after the window before the per-iteration digest). A worker that dies is
an abort; the outcomes are counted per mode and position.

    python scripts/checks/check_disagreement_after_window.py --tp 2

Aborting cases kill their workers, so each call after one starts a fresh pool (a few seconds).
Run it against an older tree by putting that tree first on PYTHONPATH: the cases use the public
API only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_TESTS = os.path.join(_ROOT, "tests", "consistency")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--modes", default="off,default")
    parser.add_argument("--positions", default="head,mid")
    parser.add_argument("--only", default="", help="comma-separated case names")
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(_TESTS))
    import _late_cases as cases

    from megatron_core.testing import DistributedTestError, run_distributed, shutdown_pools

    names = [n for n in cases.CASES if not args.only or n in args.only.split(",")]
    table = collections.defaultdict(dict)
    try:
        for mode in args.modes.split(","):
            for position in args.positions.split(","):
                for name in names:
                    try:
                        results = run_distributed(
                            cases.run_case, args.tp, name, position, mode, args.tp, timeout=60
                        )
                        outcome = cases.classify(results)
                        if not outcome.startswith(("every rank", "silent")):
                            shutdown_pools()  # a group broken by a timeout: fresh workers
                    except DistributedTestError as exc:
                        died = any(f.type_name == "WorkerDied" for f in exc.failures.values())
                        outcome = "abort" if died else f"harness: {str(exc)[:300]}"
                        shutdown_pools()
                    table[name][(mode, position)] = outcome
                    print(f"{mode:7} {position:4} {name}: {outcome}", flush=True)
    finally:
        shutdown_pools()
    columns = [(m, p) for m in args.modes.split(",") for p in args.positions.split(",")]
    print("\n| case | " + " | ".join(f"{m} / {p}" for m, p in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name in names:
        print(f"| {name} | " + " | ".join(table[name][c] for c in columns) + " |")
    print()
    for column in columns:
        counts = collections.Counter(table[name][column] for name in names)
        print(f"{column[0]} / {column[1]}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
