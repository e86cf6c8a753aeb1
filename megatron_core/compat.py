"""torch across its releases: the version as a number, and each API this package uses that is
newer than its floor (torch 2.6, megatron-core's own), with the fallback for older releases.

Everything version-dependent goes through here (every torch a user has, 2.6 to the newest); the
floor lane of CI (README "Support matrix") runs the fallbacks. Checks look for the feature itself
where torch exposes one, and at the release number otherwise.
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
    "sdpa_kernel",
    "FusedBlockOps",
    "fused_attention_block_ops",
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


# --- attention kernels (NOTE [ Fused attention ] in megatron_core/attention) ------------------

# torch.nn.attention.SDPBackend's values, as torch._fused_sdp_choice returns them
_SDPA_KERNELS = {-1: "none", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def sdpa_kernel(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale, gqa: bool):
    """The kernel ``F.scaled_dot_product_attention`` runs for these arguments: "flash",
    "efficient", "cudnn", "overrideable", "math" (its unfused composite) or "none".

    torch's private ``torch._fused_sdp_choice`` (the selector SDPA itself calls; every supported
    torch has it with ``enable_gqa``, added in 2.5); "math" where a build lacks it.
    """
    chooser = getattr(torch, "_fused_sdp_choice", None)
    if chooser is None:
        return "math"
    index = chooser(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa)
    return _SDPA_KERNELS.get(int(index), "math")


class FusedBlockOps:
    """One device's fused attention forward and backward ops that return and take the
    log-sum-exp (what a context-parallel ring merges blocks with), in one calling convention.

    ``forward(q, k, v, bias, causal, scale) -> (out, lse, saved)``: q [b, h, sq, d], k / v
    [b, h, sk, d] (heads already repeated for GQA), ``bias`` None or an additive mask of q's dtype
    broadcastable to [b, h, sq, sk]; ``causal`` is top-left aligned; out [b, h, sq, d] in q's
    dtype, lse fp32 [b, h, sq]. ``backward(dout, q, k, v, out, lse, saved, bias, causal, scale)
    -> (dq, dk, dv)`` takes the *row's* out and lse (of every block merged), as a ring needs;
    ``saved`` is what the forward returned, or None (no dropout: nothing of it is needed).

    Attributes:
        name: the aten op family ("flash_cpu", "efficient").
    """

    def __init__(self, name, forward, backward):
        self.name, self.forward, self.backward = name, forward, backward


def _cpu_flash_forward(q, k, v, bias, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    return out, lse, None


def _cpu_flash_backward(dout, q, k, v, out, lse, saved, bias, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _aligned_bias(bias, q, k):
    """``bias`` as the memory-efficient kernel reads it: rows whose stride is a multiple of 16
    elements (the values in the first sk columns), expanded to [b, h, sq, sk] as a view."""
    if bias is None:
        return None
    (b, h, sq, _), sk = q.shape, k.shape[2]
    width = -(-sk // 16) * 16
    rows = bias.new_zeros(*bias.shape[:-1], width)
    rows[..., :sk] = bias
    return rows[..., :sk].expand(b, h, sq, sk)


def _efficient_forward(q, k, v, bias, causal, scale):
    bias = _aligned_bias(bias, q, k)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    # the kernel pads the lse's last dimension to its alignment; the rows past sq are unused
    return out, lse[..., : q.shape[2]].contiguous(), (seed, offset, lse.shape[-1])


def _efficient_backward(dout, q, k, v, out, lse, saved, bias, causal, scale):
    if saved is None:  # no dropout: the Philox state is not read; the lse padded as given out
        zero = torch.zeros((), dtype=torch.int64)
        saved = (zero, zero, -(-lse.shape[-1] // 32) * 32)
    seed, offset, width = saved
    bias = _aligned_bias(bias, q, k)
    if width != lse.shape[-1]:
        lse = torch.nn.functional.pad(lse, (0, width - lse.shape[-1]))
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, bias, out, lse, seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


def fused_attention_block_ops(device_type: str) -> FusedBlockOps | None:
    """The fused block ops of a device type: torch's CPU flash kernel (``_scaled_dot_product_
    flash_attention_for_cpu`` and its backward) on "cpu", the memory-efficient kernel
    (``_scaled_dot_product_efficient_attention``: any float dtype, additive masks) on "cuda";
    None elsewhere or where this torch lacks the ops."""
    ops = torch.ops.aten
    if device_type == "cpu" and hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        return FusedBlockOps("flash_cpu", _cpu_flash_forward, _cpu_flash_backward)
    if device_type == "cuda" and hasattr(ops, "_scaled_dot_product_efficient_attention"):
        return FusedBlockOps("efficient", _efficient_forward, _efficient_backward)
    return None
