"""torch across its releases: the version as a number, and each API this package uses that is
newer than its floor (torch 2.6, megatron-core's own), with the fallback for older releases.

Everything version-dependent goes through here (DESIGN.md: "Every torch a user has"); the floor
lane of CI (README "Support matrix") runs the fallbacks. Checks look for the feature itself where
torch exposes one, and at the release number otherwise.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.utils.checkpoint  # a submodule torch < 2.7 does not import by itself

from megatron_core.errors import MegatronCoreError

__all__ = [
    "FLOOR",
    "parse_torch_version",
    "torch_version",
    "torch_at_least",
    "require_torch",
    "checkpoint_early_stop_override",
    "redispatch_torch_function",
    "default_store",
    "all_gather_single",
    "reduce_scatter_single",
    "graph_safe_generators",
    "CPU_STREAM_BASE",
    "profiler_allocations",
    "storage_holders",
]

FLOOR = (2, 6)  # setup.py's torch>=2.6

# torch.utils.checkpoint's early-stop switch: None until set_checkpoint_early_stop sets it (torch
# >= 2.7), or a plain bool that starts True (2.6), which cannot tell "unset" from "set to True".
_EARLY_STOP_DEFAULT = getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None)

_RELEASE = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def parse_torch_version(text: str) -> tuple[int, int, int]:
    """The release of a torch version string as ``(major, minor, patch)``.

    Pre-release, dev and local labels are dropped, so NVIDIA's container builds count as the
    release they precede: ``"2.10.0a0+git1a2b3c"`` -> ``(2, 10, 0)``, ``"2.11.0+cu130"`` ->
    ``(2, 11, 0)``, ``"2.6"`` -> ``(2, 6, 0)``.

    Raises:
        MegatronCoreError: ``text`` does not start with a release number.
    """
    match = _RELEASE.match(str(text))
    if match is None:
        raise MegatronCoreError(f"torch version {text!r} does not start with a release number")
    return tuple(int(part or 0) for part in match.groups())


def torch_version() -> tuple[int, int, int]:
    """The installed torch's release, as :func:`parse_torch_version` reads it."""
    return parse_torch_version(torch.__version__)


def torch_at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed torch is release ``major.minor.patch`` or newer (a pre-release or
    local build of that release counts)."""
    return torch_version() >= (major, minor, patch)


def require_torch(feature: str, major: int, minor: int) -> None:
    """Raise unless torch is at least ``major.minor``: for a feature that cannot work on older
    releases.

    Raises:
        MegatronCoreError: naming the feature, the release it needs and the installed one.
    """
    if not torch_at_least(major, minor):
        raise MegatronCoreError(
            f"{feature} needs torch >= {major}.{minor}; this is torch {torch.__version__}"
        )


def checkpoint_early_stop_override() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_early_stop`` asks for right now, or None
    when it is not in effect.

    Fallback for torch 2.6, whose switch is a bool that starts True: there only a False (set by
    the context manager) counts; True is the unset default (and early stop's default anyway).
    """
    value = getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None)
    if value is None or _EARLY_STOP_DEFAULT is None:
        return value
    return None if value == _EARLY_STOP_DEFAULT else bool(value)


def redispatch_torch_function(mode, func, types, args, kwargs):
    """Run ``func`` from ``mode``'s ``__torch_function__`` with ``mode`` active inside it.

    torch takes a mode off the stack while its handler runs; ``torch.overrides.
    redispatch_function`` (newer torch) runs ``func``'s body once without dispatching back to the
    handler, so ``with mode:`` around it makes the inner calls see the mode. Where torch lacks it
    the body runs as torch runs it by default: without the mode.
    """
    redispatch = getattr(torch.overrides, "redispatch_function", None)
    if redispatch is None:
        return func(*args, **kwargs)
    with mode:
        return redispatch(func, types, args, kwargs)


def default_store():
    """The default process group's key-value store, or None where torch does not expose it
    (a private getter of torch.distributed; present from the floor up to the newest release)."""
    import torch.distributed as dist

    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):  # no default group
        return None


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single (the old names warn there); the same call on every release.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# torch.cpu.Stream (torch >= 2.1 everywhere the floor runs; object where a build lacks it).
CPU_STREAM_BASE = getattr(torch.cpu, "Stream", object)


def graph_safe_generators() -> bool:
    """Whether this torch's generators have graph-safe states (``Generator.graphsafe_get_state``,
    which CUDA graphs need to capture draws)."""
    return hasattr(torch.Generator, "graphsafe_get_state")


def current_graph_task_id() -> int:
    """The id of the autograd backward running in this thread, -1 outside any backward
    (``torch._C._current_graph_task_id``; no public equivalent; -1 where a build lacks it)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if task_id is None else task_id()


def current_graph_exec_group():
    """The checkpoint graph-execution group of the backward running now (newer torch's
    ``torch.utils.checkpoint.GraphExecGroup``), None where none runs or torch has none."""
    group_cls = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    return group_cls._get_current_group() if group_cls is not None else None


def enclosing_saved_tensors_hooks():
    """The (pack, unpack) pair of the innermost ``saved_tensors_hooks`` context around the
    caller, or None (torch's private ``_top_saved_tensors_default_hooks``; None where absent)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def backend_config_text() -> str:
    """The default group's backend with its per-device map where torch keeps one
    (``get_backend_config``), else ``get_backend()``."""
    config = getattr(dist, "get_backend_config", None)
    return str(config() if config is not None else dist.get_backend())


def profiler_allocations(prof, mark_prefix: str):
    """What a finished ``torch.profiler.profile(profile_memory=True)`` saw: the allocator's
    events as ``(time_ns, signed bytes, device type name, address)`` and the
    ``record_function`` ranges whose names start with ``mark_prefix`` as ``(time_ns, name)``,
    each list in time order.

    Read from the event tree of the kineto results the profiler keeps
    (``prof.profiler.kineto_results.experimental_event_tree()``, every supported torch has
    it): torch's public views (``events()``, ``key_averages()``) fold each allocation into its
    op's net bytes, which hides the peak inside a step, and carry no address. Raises where a
    torch lacks them."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    tree = getattr(results, "experimental_event_tree", None)
    if tree is None:
        raise MegatronCoreError(
            f"this torch ({torch.__version__}) keeps no kineto event tree on its profiler: the "
            "allocator's timeline cannot be read on the CPU"
        )
    allocation = torch._C._profiler._EventType.Allocation
    allocations, marks = [], []
    pending = list(reversed(tree()))  # depth first, in the tree's order
    while pending:
        event = pending.pop()
        pending.extend(reversed(event.children))
        if event.tag == allocation:
            fields = event.extra_fields
            kind = torch.device(fields.device).type
            allocations.append((event.start_time_ns, fields.alloc_size, kind, fields.ptr))
        elif event.name.startswith(mark_prefix):
            marks.append((event.start_time_ns, event.name))
    allocations.sort(key=lambda item: item[0])
    marks.sort(key=lambda item: item[0])
    return allocations, marks


def storage_holders(storage: torch.UntypedStorage) -> int:
    """How many hold ``storage`` now: tensors (views, aliases, those a collective's Work keeps)
    and storage objects, ``storage`` itself included. torch's private ``_storage_Use_Count``
    (every supported torch has it; torch's own CUDA-graph trees read it)."""
    return torch._C._storage_Use_Count(storage._cdata)
