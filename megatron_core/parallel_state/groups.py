"""Creating process groups: megatron-core's create_group family plus a cache of communicators.

Re-exported by parallel_state (``parallel_state.create_group`` etc.). The NCCL-only knobs
(communicator options, SHARP, high-priority streams) only apply where a group's backend is NCCL;
see NOTE [ NCCL-only options ].

# NOTE [ NCCL-only options ]
#
# 1. nccl_communicator_config_path, high_priority_stream_groups, use_sharp / sharp_enabled_group
#    tune NCCL communicators (CTA counts, network, stream priority, in-network reduction). They
#    never change what a collective computes.
# 2. They are validated on every backend (a bad file, value or combination raises the same error
#    everywhere, before any collective), and applied only to groups whose backend is NCCL.
# 3. On gloo they are accepted and have no effect: gloo has no such settings, and since rule 1
#    says results do not depend on them, ignoring them cannot change results.
# 4. pipeline_model_parallel_comm_backend does change which library moves tensors: it must be
#    available, and "nccl"/"ucc" on the CPU device raise instead of being ignored.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist

from megatron_core import device
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state import agreement
from megatron_core.parallel_state.rank_generator import (
    hierarchical_rank_groups,
    hybrid_dp_cp_rank_groups,
)

__all__ = [
    "get_nccl_options",
    "overwrite_nccl_comm_cfgs",
    "update_pg_timeout",
    "create_group",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
]

logger = logging.getLogger(__name__)

# Keys a communicator config may set per group name (megatron-core's yaml format).
NCCL_CONFIG_KEYS = (
    "is_high_priority_stream",
    "cga_cluster_size",
    "max_ctas",
    "min_ctas",
    "net_name",
)

# Groups this rank belongs to, for update_pg_timeout; None stands for the default group.
_process_group_list: list | None = None


def _register(group, ranks) -> None:
    global _process_group_list
    if _process_group_list is None:
        _process_group_list = [None]
    if dist.get_rank() in ranks and group not in _process_group_list:
        _process_group_list.append(group)


def reset_process_group_list() -> None:
    """Forget the registered groups (destroy_model_parallel); the groups themselves live on."""
    global _process_group_list
    _process_group_list = None


def validate_nccl_comm_cfgs(cfgs, source: str) -> dict:
    """Check a communicator config ``{group name: {key: value}}`` (NOTE [ NCCL-only options ])."""
    if cfgs is None:
        return {}
    if not isinstance(cfgs, dict):
        raise MegatronCoreError(f"{source} must map group names to settings, got {cfgs!r}")
    for name, cfg in cfgs.items():
        if not isinstance(cfg, dict):
            raise MegatronCoreError(f"{source}: settings of group {name!r} ({cfg!r}) must be a map")
        unknown = [k for k in cfg if k not in NCCL_CONFIG_KEYS]
        if unknown:
            raise MegatronCoreError(
                f"{source}: group {name!r} has unknown key(s) {unknown}; allowed: "
                f"{list(NCCL_CONFIG_KEYS)}"
            )
        net = cfg.get("net_name")
        if net is not None and str(net).lower() not in ("ib", "socket"):
            raise MegatronCoreError(
                f"{source}: net_name ({net!r}) of group {name!r} must be 'IB' or 'socket'"
            )
    return cfgs


def get_nccl_options(pg_name, nccl_comm_cfgs):
    """NCCL options for the group named ``pg_name`` from a communicator config, or None.

    Args:
        pg_name: megatron-core's group name ("dp", "dp_cp", "tp", "ep_dp", ...).
        nccl_comm_cfgs: ``{group name: {key: value}}``; keys not given keep NCCL's defaults.

    Returns:
        ``torch.distributed.ProcessGroupNCCL.Options``, or None if the config has no entry.

    Raises:
        MegatronCoreError: the entry is invalid, or this torch build has no NCCL.
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = validate_nccl_comm_cfgs({pg_name: nccl_comm_cfgs[pg_name]}, "nccl_comm_cfgs")[pg_name]
    if not dist.is_nccl_available():
        raise MegatronCoreError(
            f"NCCL options for group {pg_name!r} need NCCL, which this torch build lacks"
        )
    options = dist.ProcessGroupNCCL.Options(
        is_high_priority_stream=cfg.get("is_high_priority_stream", False)
    )
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)``."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def update_pg_timeout(timeout: datetime.timedelta, pg: dist.ProcessGroup | None = None):
    """Change the timeout of one group, or of every group this rank created (``pg=None``).

    Runs a barrier on ``pg`` (the default group if None) and synchronizes the device first, so no
    collective in flight sees the change half-way. Collective over ``pg``.
    """
    if not isinstance(timeout, datetime.timedelta):
        raise MegatronCoreError(f"timeout ({timeout!r}) must be a datetime.timedelta")
    dist.barrier(pg)
    device.synchronize()
    for group in [pg] if pg is not None else (_process_group_list or [None]):
        dist.distributed_c10d._set_pg_timeout(timeout, group)
        _timeouts[id(group)] = timeout


def create_group(
    ranks=None,
    timeout=None,
    backend=None,
    pg_options=None,
    use_local_synchronization=False,
    group_desc=None,
):
    """Create a ProcessGroup over ``ranks`` (``torch.distributed.new_group``) and remember it.

    Every rank of the default group must call this, members or not (unless
    ``use_local_synchronization``). The group is registered for :func:`update_pg_timeout`.
    """
    group = dist.new_group(
        ranks=ranks,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    _register(group, range(dist.get_world_size()) if ranks is None else ranks)
    if not use_local_synchronization and agreement.needs_shadow(backend):
        # NOTE [ Host-side agreement ]: every rank, in the group's order
        shadow = dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            agreement.add_shadow(group, shadow)
    return group


# Process groups outlive the state that asked for them: (ranks, backend, options, tag) -> group,
# valid while the default (WORLD) group it was created under is alive. The timeout is not part of
# the key: a reused group gets the new timeout instead (update_pg_timeout changes it in place).
_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_GROUP_CACHE_WORLD: list = [None]
_timeouts: dict[int, datetime.timedelta] = {}


def cached_group(
    ranks: list[int],
    timeout: datetime.timedelta,
    backend: str | None = None,
    options_key: tuple = (),
    pg_options=None,
    tag: str = "",
    group_desc: str | None = None,
) -> dist.ProcessGroup:
    """:func:`create_group` with reuse: a later initialize with the same ranks gets the same group.

    Like megatron-core, destroy_model_parallel drops the state but does not tear communicators
    down; re-initializing then costs no new connections (creating and shutting down gloo pairs
    over and over is slow and, on a loaded machine, was seen to fail in connectFullMesh). Every
    rank calls this for every group in the same order, so every rank hits or misses alike.
    ``options_key`` (the settings behind ``pg_options``) and ``tag`` keep groups apart that must
    be distinct communicators (e.g. the separate all-gather group).
    """
    world = dist.group.WORLD
    if _GROUP_CACHE_WORLD[0] is not world:  # torch.distributed was re-initialized
        _GROUP_CACHE.clear()
        _timeouts.clear()
        _GROUP_CACHE_WORLD[0] = world
    key = (tuple(sorted(ranks)), backend or dist.get_backend(), options_key, tag)
    group = _GROUP_CACHE.get(key)
    if group is None:
        group = create_group(
            list(ranks),
            timeout=timeout,
            backend=backend,
            pg_options=pg_options,
            group_desc=group_desc,
        )
        _GROUP_CACHE[key] = group
    else:
        _register(group, ranks)
        if _timeouts.get(id(group)) != timeout and dist.get_rank() in ranks:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    _timeouts[id(group)] = timeout
    return group


def create_hierarchical_groups(
    rank,
    ranks,
    hierarchical_group_sizes,
    create_gloo_process_groups=False,
    pg_options=None,
    timeout=None,
    group_desc=None,
):
    """Create the groups of each level of a hierarchy over ``ranks`` (NOTE [ Rank layout ], 8).

    Example: 16 ranks g0..g15 with sizes [2, 2, 4] give level-1 groups [g0, g1] [g2, g3] ...,
    level-2 groups [g0, g2] [g1, g3] [g4, g6] ... and level-3 groups [g0, g4, g8, g12] ...

    Returns:
        ``(groups, gloo_groups)``: ``rank``'s group at each level (empty lists if ``rank`` is not
        in ``ranks``); gloo entries are None unless ``create_gloo_process_groups``.
    """
    if not isinstance(pg_options, list):
        pg_options = [pg_options] * len(hierarchical_group_sizes)
    groups, gloo_groups = [], []
    for level, level_groups in enumerate(hierarchical_rank_groups(ranks, hierarchical_group_sizes)):
        for sub_ranks in level_groups:
            group = create_group(
                sub_ranks,
                timeout=timeout,
                pg_options=pg_options[level],
                group_desc=f"HIERARCHICAL_{group_desc}_L{level}",
            )
            gloo = None
            if create_gloo_process_groups:
                gloo = create_group(
                    sub_ranks,
                    timeout=timeout,
                    backend="gloo",
                    group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}",
                )
            if rank in sub_ranks:
                groups.append(group)
                gloo_groups.append(gloo)
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(rank, ranks, pg_options):
    """Create the hybrid data x context groups over ``ranks``: consecutive chunks of 2, 4, ...

    Returns:
        ``{group size: rank's group of that size}``.
    """
    mine = {}
    for size, chunks in hybrid_dp_cp_rank_groups(list(ranks)).items():
        for chunk in chunks:
            group = create_group(
                chunk, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}"
            )
            if rank in chunk:
                mine[size] = group
    return mine
