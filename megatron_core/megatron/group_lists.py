"""``torch.distributed.new_group`` called with a rank list per rank, served on gloo (the switch's
CPU mode, NOTE [ CUDA on the CPU ], rule 6, in cpu_mode.py).

# NOTE [ Rank lists per rank ]
1. The call. torch asks every rank to call ``new_group`` with the same ``ranks``. Code written
   for NCCL often passes each rank its own group's list instead (megatron-core 0.19's
   ``test_expert_all_gather_group`` passes the rank's expert-data-parallel ranks; its pipeline
   tests' ``_populate_embedding_and_position_groups`` the first and last rank of the rank's
   pipeline): NCCL connects a group at its first collective, so the members of each list find
   each other and the program runs. gloo connects inside ``new_group``, so the same calls would
   wait forever.
2. Served. :func:`new_group_per_rank` runs inside every rank's ``new_group`` call (every rank is
   there, as torch requires): one exchange over the default group compares the lists (a hash
   each; where they differ, the lists themselves). Where they differ, every rank creates each
   distinct list with torch's ``new_group`` (the call's other arguments unchanged), in the
   order of the lowest rank that asked for it, so torch's group counter and names agree on every
   rank; each rank gets the group of its own list (``GroupMember.NON_GROUP_MEMBER`` where its own
   list leaves it out, as torch answers). These are the groups NCCL would have given.
3. Refused. Two distinct lists that share a rank cannot both be groups of one call (the rank
   would need two groups from it, and under NCCL one of them never connects), nor can "all
   ranks" (``ranks`` None or empty) beside a list: every rank raises the same
   MegatronCoreError, naming each rank's list, before any group is created.
4. ``use_local_synchronization=True`` is left to torch: only the group's members call it, and
   they agree on its list.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state import agreement

__all__ = ["new_group_per_rank"]

_ALL = "all ranks"


def _text(ranks) -> str:
    return _ALL if not ranks else json.dumps(sorted(int(r) for r in ranks))


def new_group_per_rank(original, bound):
    """Call ``original`` (torch's ``new_group``) with ``bound`` (its bound arguments) as NOTE [
    Rank lists per rank ] says: unchanged where every rank passed the same list (or only the
    members call it), else each distinct list created on every rank, this rank's group returned.

    Raises:
        MegatronCoreError: the lists overlap without being equal (rule 3), on every rank.
    """
    arguments = bound.arguments
    if arguments.get("use_local_synchronization") or not dist.is_initialized():
        return original(*bound.args, **bound.kwargs)  # rule 4
    own = _text(arguments.get("ranks"))
    world = dist.group.WORLD
    table = agreement.exchange([agreement.hash_text(own)], world)
    if bool((table == table[0]).all()):
        return original(*bound.args, **bound.kwargs)
    lists = agreement.exchange_text(own, world)
    distinct = list(dict.fromkeys(lists))  # rule 2: the order of the lowest rank asking
    _refuse_overlaps(lists, distinct)
    mine = None
    for listed in distinct:
        arguments["ranks"] = json.loads(listed)
        group = original(*bound.args, **bound.kwargs)
        if listed == own:
            mine = group
    return mine


def _refuse_overlaps(lists: list[str], distinct: list[str]) -> None:
    """Rule 3: distinct lists must be disjoint, "all ranks" alone."""
    seen: dict[int, str] = {}
    clash = _ALL in distinct
    for listed in distinct:
        for rank in [] if listed == _ALL else json.loads(listed):
            clash = clash or rank in seen
            seen.setdefault(rank, listed)
    if not clash:
        return
    shown = "; ".join(f"rank {rank}: {listed}" for rank, listed in enumerate(lists[:8]))
    more = f"; ... ({len(lists)} ranks)" if len(lists) > 8 else ""
    raise MegatronCoreError(
        f"CPU mode: torch.distributed.new_group was called with rank lists that differ between "
        f"ranks and overlap ({shown}{more}). Lists that differ are served as one group each "
        f"where they are disjoint (NCCL would connect each group at its first use); a rank in "
        f"two different lists, or 'all ranks' beside a list, cannot be one group per call. "
        f"Create each group on every rank with the same list (as parallel_state does), or pass "
        f"use_local_synchronization=True so that only a group's members call new_group"
    )
