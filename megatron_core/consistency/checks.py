"""When ranks disagree: agree first, then act, so no rank hangs, aborts or computes garbage.

Every rank of a group must call the same collective with tensors of the same shape and dtype and
with arguments that agree (vocabulary partitions, split sizes, broadcast keys). When they do not,
gloo and NCCL hang, abort the process (gloo's ``op.preamble.length <= op.nbytes``), or silently
reinterpret bytes. This module gives the package two primitives, used as switch.py says:

* :func:`agree` (always runs) exchanges one fixed-size descriptor per rank -- the op, the tensor's
  shape and dtype, a hash of the arguments that must agree, and whether this rank hit an error --
  with ONE ``all_gather`` of 16 int64 values. The size never depends on the data, so the exchange
  itself cannot mismatch (safe on gloo). If any rank brought an error, or any descriptor differs,
  every rank raises the same :class:`MegatronCoreError` naming the op, the group and each rank's
  value (the readable values are gathered only on this slow path).
* :func:`agreed_errors` wraps local checks: an error raised on one rank is shared through
  :func:`agree`, so its peers raise it too instead of blocking in the next collective.
* The switch (switch.py, :class:`CheckMode`): by default (``WINDOW``) the collectives of the
  first training iterations first call :func:`check_collective` (an :func:`agree` on their
  inputs); after them each collective is recorded in its group's per-iteration digest
  (digest.py), compared once per iteration, and the first collective of each group in an
  iteration is still agreed (NOTE [ Check window ] in switch.py). Check mode (``ALWAYS``:
  ``MEGATRON_CORE_CHECK_CONSISTENCY=1``, ``set_mode("always")``, :func:`check_mode`, or
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) agrees every collective; ``OFF``
  (``MEGATRON_CORE_CHECK_CONSISTENCY=0``, ``set_mode("off")``) none.

Cost of a check: one extra 128-byte all_gather (per rank) before the collective, plus a few
microseconds of Python; a latency cost, independent of the tensor size. After the window a
collective reads the switch and appends a record (about a microsecond); off, it only reads the
switch. The measurements, against torch's DETAIL wrapper too, are in the manual's
docs/benchmarks/consistency.md (``scripts/benchmarks/benchmark_consistency.py``).

torch's own machinery: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps the groups created
while it is set and compares a fingerprint (op type, shapes, dtypes) before each raw collective,
raising ``RuntimeError("Detected mismatch between collectives ...")``. It does not know the
package's op or group names, nor arguments that do not show in a shape (vocabulary partitions,
split sizes, the target ids), and it only covers groups created under it; so :func:`agree` checks
those, and :func:`collective_failed` turns torch's errors (that mismatch, a timeout, a dead peer's
``Connection closed by peer``) into a MegatronCoreError naming the op and the group.

# NOTE [ Agree before acting ]
1. Every exchange here has a size fixed by the group size alone: ``_SLOTS`` int64 values per rank.
   Data-dependent sizes (the readable values, error texts) are exchanged only after every rank
   has seen the same fixed-size result and decided, identically, to exchange them.
2. Every rank decides from the same gathered table, so every rank raises the same message or
   none raises: no rank is left in a collective its peers never enter. The same table closes
   a group's check window on every member alike (its last slot, not compared: NOTE [ Check
   window ] in switch.py, rule 2); the compared arguments include each rank's consistency mode
   and window size. The digest's exchange (digest.py) follows the same two rules.
3. Checks run BEFORE the local validation of a collective's inputs: once shapes and arguments
   agree, a local check that depends only on them fails on every rank alike.
4. A local check that depends on per-rank data (a rank's own rows against its split size, the
   target ids) runs inside :func:`agreed_errors`: its error reaches every rank through rule 1.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_core.consistency import digest, marks, switch
from megatron_core.consistency import text as _text
from megatron_core.consistency.switch import (
    CHECK,
    FOLD,
    HEAD,
    MARK_FIRST,
    SKIP,
    CheckMode,
    close_window,
    describe_settings,
    group_window_done,
    mode,
)
from megatron_core.errors import CollectiveError, MegatronCoreError, RankDisagreementError
from megatron_core.parallel_state.agreement import (
    SLOTS as _SLOTS,  # NOTE [ Agree before acting ], 1
)
from megatron_core.parallel_state.agreement import exchange, exchange_text
from megatron_core.parallel_state.agreement import hash_text as _hash_text
from megatron_core.parallel_state.handed import all_reduce_in_place

describe_group = _text.describe_group  # public: "the tensor-model-parallel group (...)"
collective_failed = _text.collective_failed  # public: torch's failure as a CollectiveError
named_failures = _text.named_failures  # public: ``with named_failures(op, group):``

__all__ = [
    "RankDisagreementError",
    "CollectiveError",
    "agree",
    "should_check",
    "check_collective",
    "check_ids",
    "agreed_errors",
    "checked_all_reduce",
    "agreed_splits",
    "named_failures",
    "collective_failed",
    "describe_group",
]

_MAX_DIMS = 8  # shape dimensions stored as such; more are hashed
_FAILED_SLOT = 14  # [magic, op, dtype, ndim, 8 dims, more dims, args, failed, window done]
_DONE_SLOT = 15  # this rank's windows are done (NOTE [ Check window ], rule 4); not compared
_MAGIC = 0x4D435F4147524545  # "MC_AGREE": a rank in another exchange shows up as a mismatch


# --- the exchange ----------------------------------------------------------------------------


def _exchange(values: list[int], group: dist.ProcessGroup, op: str) -> torch.Tensor:
    """All-gather ``values`` (the same length on every rank) -> [group size, len] int64 (cpu);
    a failure (a peer that never comes: the group timeout) names the check and ``op``."""
    with named_failures(f"the consistency check's all-gather before {op}", group):
        return exchange(values, group)


def _exchange_text(text: str, group: dist.ProcessGroup, op: str) -> list[str]:
    """Every rank's ``text`` (slow path, rule 1), failures named as in :func:`_exchange`."""
    with named_failures(f"the consistency check's all-gather before {op}", group):
        return exchange_text(text, group)


def _descriptor(op, tensor, shape, dtype, args, failed: bool) -> list[int]:
    if tensor is not None:
        shape = tuple(tensor.shape) if shape is None else shape
        dtype = tensor.dtype if dtype is None else dtype
    values = [_MAGIC, _hash_text(op), _hash_text(str(dtype)) if dtype is not None else 0]
    if shape is None:
        values += [-1] + [-1] * _MAX_DIMS + [0]
    else:
        dims = [int(d) for d in shape]
        head = dims[:_MAX_DIMS] + [-1] * (_MAX_DIMS - len(dims[:_MAX_DIMS]))
        values += [len(dims)] + head + [_hash_text(repr(dims[_MAX_DIMS:]))]
    values += [_hash_text(repr(sorted(args.items()))) if args else 0, int(failed)]
    assert len(values) == _FAILED_SLOT + 1
    return values + [0] * (_SLOTS - len(values))


def agree(
    op: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor | None = None,
    *,
    shape: tuple[int, ...] | torch.Size | None = None,
    dtype: torch.dtype | None = None,
    error: BaseException | None = None,
    content: torch.Tensor | None = None,
    **args,
) -> None:
    """Make the ranks of ``group`` agree before a collective, or raise on all of them.

    Every rank of ``group`` must call this (it is itself a collective: one all-gather of 16 int64
    values per rank, see NOTE [ Agree before acting ]). Compared across the group: ``op``, the
    shape and dtype of ``tensor`` (or ``shape`` / ``dtype`` given explicitly, e.g. a shape
    without the dimension that may differ), and ``args`` (keyword values compared by their
    ``repr``), and the values of ``content`` when given (a tensor that must be equal on every
    rank, e.g. token ids; compared through a position-weighted checksum, O(numel)). A rank passes
    ``error`` when its local checks failed. Nothing is done for a one-rank group except
    re-raising ``error``.

    Raises:
        RankDisagreementError: on every rank, naming the op, the group and each rank's value, if
            any rank passed ``error`` (its message is included) or any value differs.
    """
    size = dist.get_world_size(group)
    if size == 1:
        if error is not None:
            raise error
        return
    if content is not None:
        args = {**args, "content checksum": _text.checksum(content)}
    # Ranks in different modes or windows would stop checking at different collectives
    # (NOTE [ Check window ], rule 5).
    args["consistency mode"] = describe_settings()
    values = _descriptor(op, tensor, shape, dtype, args, error is not None)
    values[_DONE_SLOT] = int(group_window_done(group))
    table = _exchange(values, group, op)
    if bool(table[:, _DONE_SLOT].any()):  # the same table on every rank: closed alike
        close_window(group)
    table = table[:, :_DONE_SLOT]
    failed = bool(table[:, _FAILED_SLOT].any())
    if not failed and bool((table == table[0]).all()):
        return
    readable = json.dumps(_text.readable(op, tensor, shape, dtype, args, error))
    per_rank = [json.loads(text) for text in _exchange_text(readable, group, op)]
    raise RankDisagreementError(_text.message(op, group, per_rank)) from error


_MERGED = -1  # a backward mark's digest exchange agreed the collective: record it only


def _decide(group: dist.ProcessGroup | None) -> int:
    """switch.decide, a due backward mark made first (NOTE [ Check window ], rule 1)."""
    decision = switch.decide(group)
    return _after_mark(group, None) if decision == MARK_FIRST else decision


def _after_mark(group: dist.ProcessGroup | None, head: digest.Head | None) -> int:
    """Make the due backward mark; where the collective's group is closed, ``head`` (the
    collective) is agreed in the mark's digest exchange of that group (rule 6): ``_MERGED``."""
    name = (dist.group.WORLD if group is None else group).group_name
    if head is not None and name in switch.window().closed:
        marks.backward_mark((name, head))
        return _MERGED
    marks.backward_mark()
    return switch.decide(group)


def should_check(group: dist.ProcessGroup | None) -> bool:
    """Whether the collective about to run on ``group`` (None: WORLD) is agreed first: always
    in check mode, never when off, and in ``WINDOW`` mode while the group's window is open or
    for the group's first collective of an iteration after it (NOTE [ Check window ]). Never
    for a one-rank group. It decides only: :func:`check_collective` also records a collective
    after the window in the digest."""
    return _decide(group) in (CHECK, HEAD)


def check_collective(
    op: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor | None = None,
    *,
    shape: tuple[int, ...] | torch.Size | None = None,
    dtype: torch.dtype | None = None,
    content: torch.Tensor | None = None,
    **args,
) -> None:
    """:func:`agree` on ``op``, the tensor's shape / dtype, ``args`` and ``content`` across
    ``group`` when the mode says so (always in check mode, within the group's window by
    default); after the window, record them in the group's digest (and agree the group's first
    collective of each iteration): NOTE [ Check window ] in switch.py, rules 5 and 6. Off, or
    on a one-rank group: return at once (no checksum is computed). Called at the top of each
    collective of the package."""
    decision = switch.decide(group)
    if decision == MARK_FIRST:
        decision = _after_mark(group, digest.Head(op, tensor, shape, dtype, args, content, None))
    if decision == SKIP:
        return
    if decision != CHECK:
        digest.fold(group, op, tensor, shape, dtype, args, content)
    if decision in (CHECK, HEAD):
        agree(op, group, tensor, shape=shape, dtype=dtype, content=content, **args)


def _ids_outside(op: str, ids: torch.Tensor, limit: int) -> MegatronCoreError | None:
    if ids.numel() == 0:
        return None
    low, high = torch.stack(list(torch.aminmax(ids))).tolist()  # one device sync
    if low >= 0 and high < limit:
        return None
    bad = ids[(ids < 0) | (ids >= limit)].unique()[:8].tolist()
    return MegatronCoreError(f"{op}: ids {bad} are outside [0, vocabulary size ({limit}))")


def check_ids(op: str, group: dist.ProcessGroup, ids: torch.Tensor, limit: int) -> None:
    """Token ``ids`` must lie in ``[0, limit)``, and (when agreed: check mode, or the group's
    window) be equal on every rank of ``group``, since a vocab-parallel embedding sums every
    rank's part for the same ids. Agreed: every rank raises a RankDisagreementError naming the
    values. After the window: a local range check (one min/max and one device sync; the ids
    should be the same on every rank, so every rank raises alike) for good, and the ids' checksum
    goes into the digest (NOTE [ Check window ], rules 5 and 7). Mode OFF: nothing (zero
    vectors, megatron-core's behaviour)."""
    decision = switch.decide(group)
    if decision == MARK_FIRST:
        error = _ids_outside(op, ids, limit)
        head = digest.Head(op, ids, None, None, {"limit": limit}, ids, error)
        decision = _after_mark(group, head)  # merged: the exchange raised any error on all
    if decision in (FOLD, HEAD, _MERGED):
        digest.fold(group, op, ids, None, None, {"limit": limit}, ids)
    if decision in (CHECK, HEAD):
        agree(op, group, ids, error=_ids_outside(op, ids, limit), content=ids, limit=limit)
    elif decision != _MERGED and mode() is not CheckMode.OFF:
        error = _ids_outside(op, ids, limit)
        if error is not None:
            raise error


@contextlib.contextmanager
def agreed_errors(
    op: str, group: dist.ProcessGroup, tensor: torch.Tensor | None = None, **args
) -> Iterator[None]:
    """Run local checks in the block; an exception raised there on any rank is raised, as one
    RankDisagreementError naming the failing rank(s) and their messages, on every rank of
    ``group`` (NOTE [ Agree before acting ], rule 4). Costs one :func:`agree` exchange, which
    also compares ``tensor``'s shape and dtype and ``args`` when given (free: the exchange runs
    anyway)."""
    error = None
    try:
        yield
    except Exception as exc:  # shared with the peers, then re-raised (chained) below
        error = exc
    agree(op, group, tensor, error=error, **args)


def agreed_splits(
    op: str, group: dist.ProcessGroup, compute: Callable[[], tuple[list[int], list[int]]]
) -> tuple[list[int], list[int]]:
    """Split sizes of an all-to-all, checked across ``group`` (always on; one exchange).

    ``compute()`` returns this rank's ``(input_split_sizes, output_split_sizes)``: rows sent to
    and received from each rank, or raises after a local check failed. Every rank then learns
    every rank's sizes and raises the same error unless rank i sends rank j exactly the rows rank
    j expects from rank i, for every pair; so no rank is left in an all-to-all that cannot match.

    Returns:
        ``compute()``'s result.

    Raises:
        RankDisagreementError: on every rank, if a rank's ``compute()`` raised (its message is
            included) or the sizes do not match (every mismatching pair is named).
    """
    size = dist.get_world_size(group)
    error, in_sizes, out_sizes = None, [0] * size, [0] * size
    try:
        in_sizes, out_sizes = compute()
    except Exception as exc:  # shared with the peers below (NOTE [ Agree before acting ], 4)
        error = exc
    if size == 1:
        if error is not None:
            raise error
        return in_sizes, out_sizes
    table = _exchange([int(error is not None), *in_sizes, *out_sizes], group, op)
    if bool(table[:, 0].any()):
        agree(op, group, error=error)  # every rank takes this branch: the error texts travel
    sent, expected = table[:, 1 : 1 + size], table[:, 1 + size :]
    pairs = (sent != expected.T).nonzero().tolist()
    if not pairs:
        return in_sizes, out_sizes
    ranks = dist.get_process_group_ranks(group)
    found = "; ".join(
        f"rank {i} (global rank {ranks[i]}) sends {int(sent[i, j])} rows to rank {j} (global "
        f"rank {ranks[j]}), which expects {int(expected[j, i])}"
        for i, j in pairs[:8]
    )
    raise RankDisagreementError(
        f"{op} on {_text.describe_group(group)}: the split sizes do not match across the ranks "
        f"(input_split_sizes of every rank: {sent.tolist()}, output_split_sizes: "
        f"{expected.tolist()}): {found}"
    )


def checked_all_reduce(op: str, tensor: torch.Tensor, group=None, reduce_op=None) -> None:
    """``dist.all_reduce(tensor, reduce_op, group)`` in place, for the package's collectives
    outside tensor_parallel (gradient finalization, the training loop, tied embeddings): in
    check mode the ranks first agree on ``op``, shape and dtype (:func:`check_collective`), and a
    torch failure leaves as a CollectiveError naming ``op`` and the group. ``group`` None means
    WORLD; ``reduce_op`` None means SUM."""
    group = dist.group.WORLD if group is None else group
    reduce_op = dist.ReduceOp.SUM if reduce_op is None else reduce_op
    check_collective(op, group, tensor)
    with named_failures(op, group):  # NOTE [ Frees the CPU profiler records ]
        all_reduce_in_place(tensor, reduce_op, group)
