"""Does the recompute planner choose the same plan on a quiet machine and beside a busy one?

For each model (megatron-core's GPTModel through the switch, local spec; our GPT; both 6 layers,
hidden 96, 6 heads, sequence 320, micro-batch 3, AdamW, one CPU process: the sizes of
``check_recompute_plan_total.py``) and each budget, ``--runs`` fresh processes each plan once
(``plan_recompute``) on a quiet machine, and as many beside ``--load`` busy-loop processes (each
a Python ``while True: pass``, started before and stopped after) or, with ``--beside suite``,
beside the test suite (README's command, 2 workers, run over and over). Then every distinct
plan chosen at a budget runs side by side in one quiet process: ``--repeats`` rounds, each plan
one training step a round in a rotated order, timed by this thread's CPU time (the planner's
clock) and by the wall clock. A plan's CPU time is its rounds paired with the others' (the
contest's ``paired_times``: the median of its step over the round's geometric mean, times the
median of those means), since a step's time swings by tens of percent within one process on a
shared machine; beside it, the rounds in which the plan was slower than the fastest plan, the
minor page faults of a step (median) and the wall time's median.

``--malloc keep`` runs every planning and comparing process with glibc's allocator told to keep
the blocks it frees (``GLIBC_TUNABLES``: an mmap threshold of 1 GiB and a trim threshold of
4 GiB) instead of returning large ones to the kernel and faulting them in again at the next
step: with glibc's defaults, how many pages a step faults in depends on the process's history,
not only on the plan (on the shared 2-core VM, one plan read 5.6k and 27.6k faults per step in
two processes, 349.6 and 397.0 ms), and so does its step time.

    python scripts/benchmarks/benchmark_recompute_plan_load.py --model megatron \
        --budgets 80MiB 115.6MiB 150MiB
    python scripts/benchmarks/benchmark_recompute_plan_load.py --model ours \
        --budgets 55MiB 75MiB 100MiB

Prints per budget the plans chosen (quiet / loaded counts) and their step times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts.checks import check_recompute_plan_total as total  # noqa: E402


def _compare(kind: str, plans: list[dict], repeats: int) -> list[tuple[float, float, int, float]]:
    """Per plan (its ``fields`` and ``choices``), a training step's CPU ms by its rounds paired
    with the others', the wall ms' median, the rounds it was slower than the plan fastest by
    CPU and the median of its steps' minor page faults, the plans run round-robin in one
    process."""
    import resource

    from megatron_core.tensor_parallel.recompute.planner.contest import pair_ratios, paired_times
    from megatron_core.tensor_parallel.recompute.planner.probe import _find_blocks

    total._start(kind)
    model, optimizer, forward = total._build(kind, {}, None)
    (block,) = _find_blocks(model)
    cpu = [[] for _ in plans]
    wall = [[] for _ in plans]
    faults = [[] for _ in plans]
    for round_ in range(repeats + 1):
        for i in range(len(plans)):
            index = (i + round_) % len(plans)
            block.set_layer_recompute(plans[index]["choices"])
            start_faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            start_cpu, start_wall = time.thread_time(), time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            forward().backward()
            optimizer.step()
            if round_:  # the first round warms each plan up
                cpu[index].append((time.thread_time() - start_cpu) * 1e3)
                wall[index].append((time.perf_counter() - start_wall) * 1e3)
                faults[index].append(
                    resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start_faults
                )
    names = [str(i) for i in range(len(plans))]
    batch = dict(zip(names, cpu))
    paired = paired_times([batch], names)
    fastest = min(names, key=paired.__getitem__)
    slower = [sum(r > 1 for r in pair_ratios([batch], n, fastest)) for n in names]
    return [
        (paired[n], sorted(w)[len(w) // 2], k, sorted(f)[len(f) // 2])
        for n, w, k, f in zip(names, wall, slower, faults)
    ]


KEEP_FREED = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296"


def _child(kind: str, run: str, malloc: str = "default") -> dict:
    env = dict(os.environ)
    if malloc == "keep":
        env["GLIBC_TUNABLES"] = KEEP_FREED
    done = subprocess.run(
        [sys.executable, __file__, "--model", kind, "--run", run], capture_output=True,
        text=True, env=env,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _suite() -> list[subprocess.Popen]:
    """The repository's test suite (README's command), over and over in a session of its own
    (so that killing the session stops its workers too), its output discarded."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    loop = f"while true; do {sys.executable} -m pytest tests -q -p no:cacheprovider; done"
    return [subprocess.Popen(["bash", "-c", loop], cwd=root, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]  # fmt: skip


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("megatron", "ours"), default="megatron")
    parser.add_argument("--budgets", nargs="+", default=["80MiB", "115.6MiB", "150MiB"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes beside")
    parser.add_argument(
        "--beside", choices=("busy", "suite"), default="busy",
        help="the load: --load busy loops, or the test suite run over and over",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--malloc", choices=("default", "keep"), default="default",
        help="keep: glibc keeps the blocks it frees (GLIBC_TUNABLES) in every child",
    )  # fmt: skip
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        what, _, rest = args.run.partition(":")
        if what == "plan":
            planned = total.plan(args.model, rest)
            planned.pop("text")
            print(json.dumps(planned))
        else:
            print(json.dumps(_compare(args.model, json.loads(rest), args.repeats)))
        return
    beside = f"{args.load} busy loops" if args.beside == "busy" else "the test suite"
    print(f"model {args.model}; {args.runs} runs quiet, {args.runs} beside {beside}; malloc "
          f"{args.malloc}; machine: {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    for budget in args.budgets:
        seen: dict[str, dict] = {}
        counts = collections.Counter()
        for loaded in (False, True):
            busy = [] if not loaded else _busy(args.load) if args.beside == "busy" else _suite()
            try:
                for _ in range(args.runs):
                    planned = _child(args.model, f"plan:{budget}", args.malloc)
                    key = json.dumps(planned["choices"])
                    seen.setdefault(key, planned)
                    counts[(key, loaded)] += 1
            finally:
                _stop(busy)
        keys = list(seen)
        times = _child(args.model, "compare:" + json.dumps([seen[k] for k in keys]), args.malloc)
        fastest = min(cpu for cpu, _, _, _ in times)
        print(f"\nbudget {budget}:")
        print("| plan | quiet | loaded | predicted peak (MiB) | CPU ms / step (paired) | "
              f"vs fastest | rounds slower than the fastest (of {args.repeats}) | "
              "page faults / step | wall ms / step |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for key, (cpu, wall, slower, faults) in zip(keys, times):
            shown = seen[key]["fields"] if args.model == "megatron" else key
            print(f"| {shown} | {counts[(key, False)]} | {counts[(key, True)]} | "
                  f"{seen[key]['predicted'] / 2**20:.1f} | {cpu:.1f} | {cpu / fastest:.3f} | "
                  f"{slower} | {faults:.0f} | {wall:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
