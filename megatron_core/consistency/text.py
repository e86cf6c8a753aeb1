"""Readable text for the consistency checks (private): group names, call sites, the values
each rank reports on the slow path, the one message every rank raises, and the naming of
torch's own failures (:func:`named_failures`).

Everything here runs only after a disagreement was found, except :func:`describe_group` (also
used for torch's errors), the checksums (agreed contents, the digest's records) and
:class:`named_failures` (around every raw collective).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_core.errors import CollectiveError, MegatronCoreError
from megatron_core.parallel_state.deadline import PeerDeadlineError

_SKIPPED_MODULES = (
    "megatron_core.consistency.checks",
    "megatron_core.consistency.text",
    "megatron_core.testing.harness",
    "megatron_core.testing.worker",
)


_KIND_NAMES = {
    "tp": "tensor-model-parallel",
    "pp": "pipeline-model-parallel",
    "dp": "data-parallel",
    "dp-cp": "data-parallel (with context parallel)",
    "cp": "context-parallel",
    "mp": "model-parallel",
    "ep": "expert-model-parallel",
}


def describe_group(group: dist.ProcessGroup | None) -> str:
    """A readable name: "the tensor-model-parallel group (global ranks [0, 1])"."""
    if group is None or group is dist.group.WORLD:
        size = dist.get_world_size()
        ranks = list(range(size)) if size <= 16 else f"0..{size - 1}"
        return f"the default (WORLD) group (global ranks {ranks})"
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return f"process group {group!r}"
    kinds = []
    try:
        from megatron_core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            groups = getattr(parallel_state.get_parallel_state(), "groups", {})
            kinds = [kind for kind, pg in groups.items() if pg is group]
    except Exception:  # naming must never fail the error it names
        kinds = []
    if not kinds:
        return f"the process group of global ranks {ranks}"
    known = [kind for kind in _KIND_NAMES if kind in kinds]  # tensor-model-parallel first
    names = [_KIND_NAMES[kind] for kind in known] or sorted(kinds)
    return f"the {' / '.join(names[:2])} group (global ranks {ranks})"


def _qualname(frame) -> str:
    """The qualified name of the function ``frame`` runs (``Class.method``)."""
    qualname = getattr(frame.f_code, "co_qualname", None)  # Python >= 3.11
    return qualname if qualname is not None else qualname_by_lookup(frame.f_code, frame.f_globals)


def qualname_by_lookup(code, module_globals: dict) -> str:
    """Python 3.10's stand-in for ``code.co_qualname``: the qualified name of the module's
    function or class member (static and class methods included) that owns ``code``, else the
    bare ``co_name`` (a nested function)."""
    for value in list(module_globals.values()):
        members = vars(value).values() if isinstance(value, type) else (value,)
        for member in members:
            function = getattr(member, "__func__", member)  # staticmethod / classmethod
            if getattr(function, "__code__", None) is code:
                return function.__qualname__
    return code.co_name


def call_site() -> str:
    """The package functions on the stack, outermost first (error path only)."""
    names = []
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        qualname = _qualname(frame)
        if (
            module.startswith("megatron_core.")
            and module not in _SKIPPED_MODULES
            and (not qualname.startswith("_") or qualname.endswith((".forward", ".backward")))
        ):
            names.append(qualname)
        frame = frame.f_back
    return " > ".join(reversed(names[:4])) or "(outside megatron_core)"


def readable(op, tensor, shape, dtype, args, error) -> dict[str, str]:
    """The fields one rank reports for the slow path, as text: ``op``, the shape and dtype
    (``shape`` / ``dtype`` where given, else ``tensor``'s), each of ``args`` by name, the call
    site, and ``error`` (the exception this rank's collective raised, or None)."""
    if tensor is not None:
        shape = tuple(tensor.shape) if shape is None else shape
        dtype = tensor.dtype if dtype is None else dtype
    fields = {"op": op}
    if shape is not None:
        fields["shape"] = str(tuple(int(d) for d in shape))
    if dtype is not None:
        fields["dtype"] = str(dtype)
    fields.update({name: repr(value) for name, value in sorted(args.items())})
    fields["call site"] = call_site()
    if error is not None:
        fields["error"] = f"{type(error).__name__}: {error}"
    return fields


def message(op: str, group: dist.ProcessGroup, per_rank: list[dict[str, str]]) -> str:
    """The one message every rank of ``group`` raises, from every rank's :func:`readable`
    fields (``per_rank``, by group rank): the ranks where ``op`` failed, with their errors;
    else each field on which the ranks disagree, with every rank's value."""
    ranks = dist.get_process_group_ranks(group) if group is not dist.group.WORLD else None
    ranks = ranks or list(range(len(per_rank)))

    def who(index: int) -> str:
        return f"rank {index} (global rank {ranks[index]})"

    where = describe_group(group)
    ops = list(dict.fromkeys(fields["op"] for fields in per_rank))
    op = ops[0] if len(ops) == 1 else "a collective (the ranks are in different ones)"
    failures = [(r, fields["error"]) for r, fields in enumerate(per_rank) if "error" in fields]
    if failures:
        found = "; ".join(f"{who(r)}: {text}" for r, text in failures)
        return (
            f"{op} failed on {len(failures)} of the {len(per_rank)} ranks of {where} (every rank "
            f"raises this error): {found}"
        )
    names = list(dict.fromkeys(name for fields in per_rank for name in fields))
    differ = [
        name
        for name in names
        if name != "call site" and len({fields.get(name, "-") for fields in per_rank}) > 1
    ]
    if "op" in differ:
        differ.append("call site")
    parts = [
        f"{name}: "
        + ", ".join(f"{who(r)} = {fields.get(name, '-')}" for r, fields in enumerate(per_rank))
        for name in differ
    ]
    return f"consistency check failed before {op} on {where}: the ranks disagree on " + (
        "; ".join(parts) or "an argument hash"
    )


_WEIGHTS: dict[tuple, torch.Tensor] = {}  # (numel, device, dtype) -> 1..1009 repeating


def _weights(numel: int, where: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (numel, where, dtype)
    weights = _WEIGHTS.get(key)
    if weights is None:
        if len(_WEIGHTS) >= 16:  # a few shapes recur (ids, targets, saved inputs)
            _WEIGHTS.clear()
        weights = torch.arange(numel, device=where) % 1009 + 1
        weights = _WEIGHTS[key] = weights.to(dtype)
    return weights


def device_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum and position-weighted sum of the values (weights 1..1009), as a float64 tensor [2] on
    the tensor's device (no sync): equal tensors give equal checksums; a changed or moved value
    almost surely changes one. Floating values are summed in their own precision (float32 for
    half types, a dot product with cached weights: one pass each), integers exactly."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        if flat.element_size() < 4:
            flat = flat.float()
        weights = _weights(flat.numel(), flat.device, flat.dtype)
        sums = [flat.sum(), torch.dot(flat, weights)]
    else:
        flat = flat.long()
        sums = [flat.sum(), (flat * _weights(flat.numel(), flat.device, torch.long)).sum()]
    return torch.stack(sums).double()


def checksum(tensor: torch.Tensor) -> str:
    """:func:`device_checksum` as text (one device sync)."""
    total, weighted = device_checksum(tensor).tolist()
    return f"{total!r}/{weighted!r}"


def collective_failed(op: str, group: dist.ProcessGroup | None, exc: BaseException):
    """The CollectiveError to raise (``from exc``) when torch.distributed failed inside ``op``:
    names the op and the group and keeps torch's message (timeout, dead peer, mismatch)."""
    text = str(exc).strip()
    hint = ""
    if "Connection closed by peer" in text or "Connection reset" in text:
        hint = " (a peer process of the group died or closed its connection)"
    elif isinstance(exc, PeerDeadlineError):
        hint = " (a peer did not enter the collective within the peer deadline)"
    elif "Timed out" in text or "timeout" in text.lower():
        hint = " (a peer did not enter the collective within the group timeout)"
    elif "Detected mismatch between collectives" in text:
        hint = " (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL check found the ranks in different calls)"
    return CollectiveError(f"{op} on {describe_group(group)} failed{hint}: {text}")


class named_failures:  # noqa: N801 (used like a function: ``with named_failures(op, group):``)
    """Context manager around a raw torch.distributed call: a RuntimeError from torch (timeout,
    dead peer, torch's own mismatch check) leaves as a CollectiveError naming ``op`` and
    ``group`` (see :func:`collective_failed`). A plain class: entering costs well under 1 us."""

    __slots__ = ("op", "group")

    def __init__(self, op: str, group: dist.ProcessGroup | None):
        self.op, self.group = op, group

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if isinstance(exc, RuntimeError) and not isinstance(exc, MegatronCoreError):
            raise collective_failed(self.op, self.group, exc) from exc
        return False
