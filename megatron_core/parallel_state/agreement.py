"""Agree over a group before acting: the fixed-size exchange and the arguments of set-up.

Every rank of a group enters the same :func:`exchange` (an all-gather whose size is fixed by the
group size and the slot count alone, never by the data), so the exchange itself cannot mismatch.
Readable, data-sized texts travel only afterwards, through :func:`exchange_text`, when every rank
has seen the same table and decided alike to send them. megatron_core.consistency builds its
collective checks on these two primitives (NOTE [ Agree before acting ] in consistency/checks.py);
:func:`agree_on_arguments` is the step of ``initialize_model_parallel`` that makes a rank whose
arguments differ, or whose validation failed alone, raise on every rank instead of leaving its
peers waiting in ``new_group``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_core import compat, device
from megatron_core.errors import CollectiveError, RankDisagreementError
from megatron_core.parallel_state import deadline
from megatron_core.parallel_state.handed import Handed

__all__ = [
    "SLOTS",
    "hash_text",
    "exchange",
    "exchange_text",
    "host_group",
    "needs_shadow",
    "add_shadow",
    "agree_on_arguments",
    "add_agreed_setting",
]

SLOTS = 16  # int64 values per rank in every exchange
_ARGUMENTS_MAGIC = 0x4D435F494E495431  # "MC_INIT1": a rank in another exchange shows as a mismatch
_all_gather_single = compat.all_gather_single


# Process-wide settings every rank must share, compared by every agree_on_arguments: name ->
# a function returning the readable value (megatron_core.consistency adds its mode and window).
_SETTINGS: dict[str, Callable[[], str]] = {
    # NOTE [ Peer deadline ], rule 5
    f"peer deadline ({deadline.DEADLINE_ENV})": lambda: repr(deadline.peer_deadline()),
}


def add_agreed_setting(name: str, value: Callable[[], str]) -> None:
    """Compare ``value()`` across WORLD in every :func:`agree_on_arguments` (e.g. at
    ``initialize_model_parallel``), under ``name``: a setting that must be the same on every
    rank although no argument carries it."""
    _SETTINGS[name] = value


@functools.lru_cache(maxsize=4096)
def hash_text(text: str) -> int:
    """A stable non-negative 63-bit hash of ``text`` (the same on every rank and every run)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


# NOTE [ Host-side agreement ]
# An agreement decides on the host, from a table every rank reads. On a group whose backend
# runs CPU tensors (gloo, or a "cpu:gloo,cuda:nccl" pair) the exchange runs there on CPU
# tensors. On a device-only group (NCCL) the exchange would run on the device, and reading the
# table back would make the host wait for the device's whole queue (every kernel launched
# before the check): while the check window is open, the host could no longer run ahead of the
# GPU. So every device-only group the package creates (parallel_state's, through
# groups.create_group) gets a gloo shadow: a gloo group of the same ranks, created right after
# it, by every rank in the same order as the group itself (a shadow created lazily at the first
# agreement would need torch's use_local_synchronization, whose group names depend on how many
# groups each rank already knows, so members that differ there never meet). The exchange then
# waits for the peers' hosts only, under the peer deadline like any gloo wait. A device-only
# group created elsewhere (by the user) has no shadow: its agreements run on the device.
_SHADOWS: dict[dist.ProcessGroup, dist.ProcessGroup] = {}
_SHADOW_GLOO_GROUPS = False  # tests: shadow gloo groups too, to run the path on a CPU


def _runs_cpu_tensors(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group))


def needs_shadow(backend) -> bool:
    """Whether a group of ``backend`` (None: the default group's) gets a gloo shadow."""
    name = str(dist.get_backend() if backend is None else backend)
    return _SHADOW_GLOO_GROUPS or "gloo" not in name


def add_shadow(group: dist.ProcessGroup, shadow: dist.ProcessGroup) -> None:
    """Exchange ``group``'s agreements on ``shadow`` (a gloo group of the same ranks)."""
    _SHADOWS[group] = shadow


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group an agreement over ``group`` exchanges on: its gloo shadow where it has one,
    else ``group`` itself (NOTE [ Host-side agreement ]). No collective runs."""
    return _SHADOWS.get(group, group)


def _buffer_device(group: dist.ProcessGroup) -> torch.device:
    return torch.device("cpu") if _runs_cpu_tensors(group) else device.current_device()


def exchange(values: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``values`` (the same length on every rank) over ``group`` (on its host group:
    NOTE [ Host-side agreement ]).

    Returns:
        An int64 CPU tensor [group size, len(values)]: row i holds rank i's values.
    """
    group = host_group(group)
    local = torch.tensor(values, dtype=torch.int64, device=_buffer_device(group))
    gathered = local.new_empty(dist.get_world_size(group) * len(values))
    handed = Handed(gathered, local)  # NOTE [ Frees the CPU profiler records ]
    work = _all_gather_single(*handed.tensors, group=group, async_op=True)
    handed.release()
    deadline.wait(work, "the agreement's all-gather", group)  # NOTE [ Peer deadline ]
    del work
    handed.settle()
    return gathered.view(-1, len(values)).cpu()


def exchange_text(text: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's ``text``, index = group rank: the byte sizes first (one :func:`exchange`),
    then the UTF-8 bytes padded to the longest. Every rank of ``group`` must call it."""
    data = text.encode()
    sizes = exchange([len(data)] + [0] * (SLOTS - 1), group)[:, 0].tolist()
    group = host_group(group)
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else 0
    gathered = padded.to(_buffer_device(group)).new_empty(len(sizes) * max(sizes))
    handed = Handed(gathered, padded.to(gathered.device))
    work = _all_gather_single(*handed.tensors, group=group, async_op=True)
    handed.release()
    deadline.wait(work, "the agreement's text all-gather", group)
    del work
    handed.settle()
    rows = gathered.view(len(sizes), -1).cpu()
    return [bytes(rows[r, : sizes[r]].tolist()).decode() for r in range(len(sizes))]


def agree_on_arguments(op: str, arguments: dict[str, str]) -> None:
    """Make every rank of WORLD agree on ``arguments`` (name -> readable value), or raise.

    One :func:`exchange` of a digest per rank; only when the digests differ do the readable
    values travel. Every rank sees the same table, so every rank returns or every rank raises
    the same error.

    Raises:
        RankDisagreementError: on every rank, naming each argument whose value differs and each
            rank's value of it.
        CollectiveError: the exchange itself failed in torch.distributed (a dead peer, a timeout).
    """
    world = dist.group.WORLD
    if dist.get_world_size(world) == 1:
        return
    arguments = {**arguments, **{name: value() for name, value in _SETTINGS.items()}}
    digest = hash_text(repr(sorted(arguments.items())))
    try:
        table = exchange([_ARGUMENTS_MAGIC, hash_text(op), digest] + [0] * (SLOTS - 3), world)
        if bool((table == table[0]).all()):
            return
        per_rank = [json.loads(t) for t in exchange_text(json.dumps(arguments), world)]
    except RuntimeError as exc:
        raise CollectiveError(f"{op}: agreeing on the arguments over WORLD failed: {exc}") from exc
    names = list(dict.fromkeys(name for values in per_rank for name in values))
    parts = [
        f"{name}: "
        + ", ".join(f"rank {r} = {values.get(name, '-')}" for r, values in enumerate(per_rank))
        for name in names
        if len({values.get(name, "-") for values in per_rank}) > 1
    ]
    raise RankDisagreementError(
        f"{op}: the ranks of the default (WORLD) group (global ranks "
        f"{list(range(len(per_rank)))}) were called with different arguments (every rank raises "
        "this error): " + ("; ".join(parts) or "an argument hash")
    )
