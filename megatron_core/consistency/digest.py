"""The per-iteration digest of the collectives after the check window (NOTE [ Check window ] in
switch.py, rule 5).

After a group's window has closed, :func:`fold` appends each of its collectives' record to the
group's list (no exchange, no device sync: a collective's contents are summed by a checksum
kernel into a device tensor). Once per iteration, :func:`compare` exchanges on each group one
fixed-size row per rank -- the hash of the list, its length, the settings -- and only where the
rows differ the readable records, from which every rank builds the same message naming the
first collective that differs (and what it was in the iteration before: the records the ranks
last agreed on are kept per group).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_core.consistency import switch
from megatron_core.consistency import text as _text
from megatron_core.errors import RankDisagreementError
from megatron_core.parallel_state.agreement import SLOTS, exchange, exchange_text, hash_text

__all__ = ["Head", "fold", "compare", "discard", "pending"]

_MAGIC = 0x4D435F4449474553  # "MC_DIGES": a rank in another exchange shows up as a mismatch


@dataclasses.dataclass
class _Records:
    """One group's records since its last digest, and the ones the ranks last agreed on."""

    records: list = dataclasses.field(default_factory=list)  # (op, shape, dtype, args, content)
    contents: list = dataclasses.field(default_factory=list)  # device checksums, by index
    agreed: list = dataclasses.field(default_factory=list)  # readable, from the last digest
    agreed_raw: tuple | None = None  # (records, checksums) of the last digest, made readable
    # only when a message needs them


_GROUPS: dict[str, _Records] = {}


def _reset() -> None:
    _GROUPS.clear()


switch.on_restart(_reset)


def fold(group: dist.ProcessGroup | None, op: str, tensor, shape, dtype, args, content) -> None:
    """Append the record of ``op`` on ``group`` (None: WORLD) to its list: the op, the shape and
    dtype of ``tensor`` (or ``shape`` / ``dtype``), ``args`` (compared by ``repr``) and, for
    ``content``, a checksum computed on its device (no sync)."""
    name = (dist.group.WORLD if group is None else group).group_name
    entry = _GROUPS.get(name)
    if entry is None:
        entry = _GROUPS[name] = _Records()
    if tensor is not None:
        shape = tensor.shape if shape is None else shape
        dtype = tensor.dtype if dtype is None else dtype
    index = -1
    if content is not None:
        index = len(entry.contents)
        entry.contents.append(_text.device_checksum(content))
    items = tuple(sorted(args.items())) if args else ()
    entry.records.append((op, None if shape is None else tuple(shape), dtype, items, index))


def pending(group: dist.ProcessGroup | None) -> int:
    """How many records ``group`` (None: WORLD) holds for its next digest."""
    entry = _GROUPS.get((dist.group.WORLD if group is None else group).group_name)
    return 0 if entry is None else len(entry.records)


def discard() -> None:
    """Drop every record since the last digest (an iteration block left by an exception: the
    ranks that raised alike start the next iteration alike)."""
    for entry in _GROUPS.values():
        entry.records, entry.contents = [], []


def _readable(records: list, checksums: list) -> list[dict[str, str]]:
    out = []
    for op, shape, dtype, items, index in records:
        fields = {"op": op}
        if shape is not None:
            fields["shape"] = str(tuple(int(d) for d in shape))
        if dtype is not None:
            fields["dtype"] = str(dtype)
        fields.update({name: repr(value) for name, value in items})
        if index >= 0:
            fields["content checksum"] = "{!r}/{!r}".format(*checksums[index])
        out.append(fields)
    return out


class Head(NamedTuple):
    """The collective about to run when a backward mark is due (NOTE [ Check window ], rule 6):
    agreed in the digest's exchange of its group instead of an exchange of its own."""

    op: str
    tensor: torch.Tensor | None
    shape: tuple | None
    dtype: torch.dtype | None
    args: dict
    content: torch.Tensor | None
    error: BaseException | None


def _head_values(head: Head) -> tuple[list[int], dict]:
    """(two slots: the head's hash and whether this rank's local checks failed, the args as
    agree compares them)."""
    args = dict(head.args)
    if head.content is not None:
        args["content checksum"] = _text.checksum(head.content)
    tensor, shape, dtype = head.tensor, head.shape, head.dtype
    if tensor is not None:
        shape = tuple(tensor.shape) if shape is None else shape
        dtype = tensor.dtype if dtype is None else dtype
    described = repr((head.op, None if shape is None else tuple(shape), str(dtype)))
    return [hash_text(described + repr(sorted(args.items()))), int(head.error is not None)], args


def compare(groups, where: str, marks: int, head: tuple[str, Head] | None = None) -> None:
    """Compare every group's records since its last digest across its ranks (NOTE [ Check
    window ], rule 5): ``groups`` is ``[(name, group)]`` in name order, the same on every rank;
    ``where`` says where in the iteration (for the message); ``marks`` is the iteration count.
    ``head``: (group name, the collective about to run on it), agreed in that group's exchange.

    Raises:
        RankDisagreementError: on every rank of a group whose records (or head) differ, after
            every group has been compared (the first such group's message).
        CollectiveError: the exchange itself failed (a dead peer, the peer deadline).
    """
    settings = hash_text(switch.describe_settings())
    found = []
    for name, group in groups:
        mine = head[1] if head is not None and head[0] == name else None
        if dist.get_world_size(group) == 1:
            continue
        entry = _GROUPS.get(name)
        if entry is None:
            entry = _GROUPS[name] = _Records()
        records, contents = entry.records, entry.contents
        entry.records, entry.contents = [], []
        checksums = torch.stack(contents).cpu().tolist() if contents else []
        text = repr(records) + "|" + repr(checksums)
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        values = [_MAGIC, digest >> 1, len(records), settings, marks]
        head_slots, head_args = _head_values(mine) if mine is not None else ([0, 0], {})
        table = _exchange(values + head_slots + [0] * (SLOTS - len(values) - 2), group)
        if not bool(table[:, 6].any()) and bool((table == table[0]).all()):
            entry.agreed_raw = (records, checksums)
            continue
        info = {"records": _readable(records, checksums), "iterations": marks}
        info["settings"] = switch.describe_settings()
        if entry.agreed_raw is not None:
            info["before"] = _readable(*entry.agreed_raw)
        if mine is not None:
            h = mine
            info["head"] = _text.readable(h.op, h.tensor, h.shape, h.dtype, head_args, h.error)
        per_rank = [json.loads(t) for t in _exchange_text(json.dumps(info), group)]
        heads = [r.get("head") for r in per_rank]
        if heads[0] is not None and (
            any("error" in h for h in heads) or any(h != heads[0] for h in heads)
        ):  # the collective about to run first: as its own agreement would name it
            found.append(_text.message(heads[0]["op"], group, heads))
        else:
            found.append(_message(group, where, per_rank))
    if found:
        more = f" (and {len(found) - 1} more group(s))" if len(found) > 1 else ""
        raise RankDisagreementError(found[0] + more)


def _exchange(values: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    with _text.named_failures("the iteration digest's all-gather", group):
        return exchange(values, group)


def _exchange_text(text: str, group: dist.ProcessGroup) -> list[str]:
    with _text.named_failures("the iteration digest's all-gather", group):
        return exchange_text(text, group)


def _message(group: dist.ProcessGroup, where: str, per_rank: list[dict]) -> str:
    ranks = dist.get_process_group_ranks(group)

    def who(index: int) -> str:
        return f"rank {index} (global rank {ranks[index]})"

    head = (
        f"the iteration digest of {_text.describe_group(group)} {where} found that the ranks "
        "ran different collectives since the last digest (every rank raises this error): "
    )
    lists = [info["records"] for info in per_rank]
    for key in ("settings", "iterations"):
        if len({repr(info[key]) for info in per_rank}) > 1:
            values = ", ".join(f"{who(r)} = {info[key]}" for r, info in enumerate(per_rank))
            return head + f"{key}: {values}"
    longest = max(len(records) for records in lists)
    first = next(
        (
            i
            for i in range(longest)
            if len({json.dumps(records[i]) if i < len(records) else "" for records in lists}) > 1
        ),
        None,
    )
    if first is None:  # the hashes differ, the readable records do not
        return head + "their records hash differently, though they read the same"
    sizes = {len(records) for records in lists}
    if len(sizes) == 1:
        counts = f"of the {sizes.pop()} each rank ran differs"
    else:
        ran = ", ".join(f"{who(r)} ran {len(rs)}" for r, rs in enumerate(lists))
        counts = f"differs ({ran})"
    at = [records[first] if first < len(records) else None for records in lists]
    ops = {fields["op"] for fields in at if fields is not None}
    op = f" ({ops.pop()})" if len(ops) == 1 else ""
    names = list(dict.fromkeys(name for fields in at if fields is not None for name in fields))
    parts = []
    for name in names:
        values = ["none" if fields is None else fields.get(name, "-") for fields in at]
        if len(set(values)) > 1:
            parts.append(f"{name}: " + ", ".join(f"{who(r)} = {v}" for r, v in enumerate(values)))
    text = head + f"collective #{first + 1}{op} {counts}: " + "; ".join(parts)
    before = [info.get("before") for info in per_rank]
    if before[0] is not None and all(b == before[0] for b in before) and first < len(before[0]):
        was = ", ".join(f"{name} {value}" for name, value in before[0][first].items())
        text += f"; in the iteration before, collective #{first + 1} was {was} on every rank"
    return text
