"""Child-process bodies for tests/megatron/test_megatron_children.py (importable by spawned
children)."""

import pickle
import sys


def served_here() -> bool:
    """Whether megatron.core.parallel_state in this process is this package's module."""
    import megatron.core.parallel_state as mcore_ps

    import megatron_core.parallel_state as ours

    return mcore_ps is ours


def unpickle_then_report(blob: bytes, queue) -> None:
    """Unpickle ``blob`` (a tensor) first, then report which parallel_state megatron serves."""
    try:
        tensor = pickle.loads(blob)
        queue.put((tensor.tolist(), served_here(), "megatron" in sys.modules))
    except BaseException as exc:  # reported to the parent as text
        queue.put(("error", f"{type(exc).__name__}: {exc}", None))


def rank_body(tensor):
    """A harness rank: install the switch after the arguments were unpickled, as tests do."""
    from megatron_core import megatron as switch

    switch.install()
    return tensor.tolist(), served_here()


def parent_main(mode: str) -> None:
    """``python -c`` entry: import megatron.core first (its pickling then names megatron), pickle
    a tensor, and hand it to children; prints one line per child."""
    import torch

    from megatron_core import megatron as switch

    if mode == "switch":
        switch.install()
    import megatron.core  # noqa: F401  (0.19 replaces torch's storage unpickler here)

    tensor = torch.arange(4.0)
    blob = pickle.dumps(tensor)
    print("names-megatron", b"megatron" in blob)
    if mode == "harness":
        from megatron_core.testing import run_distributed

        for result in run_distributed(rank_body, 2, tensor):
            print("harness", result)
        return
    import multiprocessing

    for method in ("spawn", "forkserver") if mode == "switch" else ("spawn",):
        ctx = multiprocessing.get_context(method)
        queue = ctx.Queue()
        child = ctx.Process(target=unpickle_then_report, args=(blob, queue))
        child.start()
        print(method, queue.get(timeout=240))
        child.join(timeout=60)
