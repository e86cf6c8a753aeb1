"""initialize_model_parallel's options (validated first) and its last step: creating the groups.

Every rank creates every group of every kind, in the same order, and keeps the ones it belongs
to. The order follows megatron-core 0.16 where it matters: the data x context groups come first,
because NCCL SHARP applies only to the first communicator created with NCCL_COLLNET_ENABLE=1.
NCCL settings are applied only to NCCL groups (NOTE [ NCCL-only options ] in groups.py).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from megatron_core import device
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.groups import (
    cached_group,
    get_nccl_options,
    overwrite_nccl_comm_cfgs,
    validate_nccl_comm_cfgs,
)

__all__ = ["GroupOptions", "validated_options", "create_groups"]


@dataclass(frozen=True)
class GroupOptions:
    """How to create the groups: timeout, backends, NCCL settings (validated)."""

    timeout: datetime.timedelta
    pp_backend: str | None
    nccl_comm_cfgs: dict
    sharp_enabled_group: str | None
    gloo: bool
    all_gather_group: bool
    num_distributed_optimizer_instances: int


def validated_options(a: dict) -> GroupOptions:
    """Check the non-size arguments of initialize_model_parallel (NOTE [ NCCL-only options ])."""
    minutes = a["distributed_timeout_minutes"]
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0:
        raise MegatronCoreError(f"distributed_timeout_minutes ({minutes!r}) must be a number > 0")
    sharp_group = a["sharp_enabled_group"]
    if a["use_sharp"]:
        sharp_group = "dp" if sharp_group is None else sharp_group
        if sharp_group not in ("dp", "dp_replica"):
            raise MegatronCoreError(
                f"sharp_enabled_group ({sharp_group!r}) must be 'dp' or 'dp_replica'"
            )
        if sharp_group == "dp_replica" and a["num_distributed_optimizer_instances"] <= 1:
            raise MegatronCoreError(
                "sharp_enabled_group ('dp_replica') needs num_distributed_optimizer_instances "
                f"({a['num_distributed_optimizer_instances']}) > 1"
            )
    elif sharp_group is not None:
        raise MegatronCoreError(
            f"sharp_enabled_group ({sharp_group!r}) is only valid with use_sharp=True"
        )
    pp_backend = a["pipeline_model_parallel_comm_backend"]
    _validate_pp_backend(pp_backend)
    cfgs = load_nccl_config(a["nccl_communicator_config_path"])
    high_priority = a["high_priority_stream_groups"] or []
    if isinstance(high_priority, str) or not all(isinstance(n, str) for n in high_priority):
        raise MegatronCoreError(
            f"high_priority_stream_groups ({high_priority!r}) must be a list of group names "
            f"such as ['dp_cp', 'ep_dp']"
        )
    for name in high_priority:
        overwrite_nccl_comm_cfgs(cfgs, name, ("is_high_priority_stream", True))
    return GroupOptions(
        timeout=datetime.timedelta(minutes=minutes),
        pp_backend=pp_backend,
        nccl_comm_cfgs=cfgs,
        sharp_enabled_group=sharp_group if a["use_sharp"] else None,
        gloo=bool(a["create_gloo_process_groups"]),
        all_gather_group=bool(a["create_all_gather_group"]),
        num_distributed_optimizer_instances=a["num_distributed_optimizer_instances"],
    )


def _validate_pp_backend(backend: str | None) -> None:
    if backend not in (None, "nccl", "ucc"):
        raise MegatronCoreError(
            f"pipeline_model_parallel_comm_backend ({backend!r}) must be None, 'nccl' or 'ucc'"
        )
    if backend is None:
        return
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_ucc_available()
    if not available:
        raise MegatronCoreError(
            f"pipeline_model_parallel_comm_backend ({backend!r}) is not available in this torch "
            f"build"
        )
    if not device.is_accelerator():
        raise MegatronCoreError(
            f"pipeline_model_parallel_comm_backend ({backend!r}) moves device tensors, but the "
            f"device type is {device.device_type()!r}; leave it None on CPU"
        )
    if backend == "ucc" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise MegatronCoreError(
            "pipeline_model_parallel_comm_backend ('ucc') needs CUDA_DEVICE_MAX_CONNECTIONS > 1 "
            "(it is 1)"
        )


def load_nccl_config(path: str | None) -> dict:
    """Read and check a communicator config yaml ({} for None); needs PyYAML."""
    if path is None:
        return {}
    try:
        import yaml
    except ImportError as e:
        raise MegatronCoreError(
            f"nccl_communicator_config_path ({path!r}) needs the PyYAML package: pip install pyyaml"
        ) from e
    try:
        with open(path) as stream:
            cfgs = yaml.safe_load(stream)
    except OSError as e:
        raise MegatronCoreError(f"nccl_communicator_config_path ({path!r}) unreadable: {e}") from e
    return dict(validate_nccl_comm_cfgs(cfgs, f"nccl_communicator_config_path ({path!r})"))


# Creation order and megatron-core's group name for NCCL settings, per kind.
_NCCL_NAMES = {
    "dp-cp": "dp_cp",
    "intra-dp-cp": "intra_dp_cp",
    "dp": "dp",
    "cp": "cp",
    "mp": "mp",
    "tp": "tp",
    "pp": "pp",
    "embedding": "embd",
    "position_embedding": "pos_embd",
    "tp-dp-cp": "tp_dp_cp",
    "tp-dp": "tp_dp",
    "tp-cp": "tp_cp",
    "ep": "ep",
    "expt-tp": "ep_tp",
    "tp-ep": "tp_ep_mp",
    "tp-ep-pp": "tp_ep_pp",
    "expt-dp": "ep_dp",
    "intra-expt-dp": "intra_ep_dp",
    "inter-dist-opt": "inter_ep_dp",
    "intra-dist-opt": "intra_dist_opt_instance",
    "gtp-remat": "gtp_remat",
    "expt-gtp-remat": "expt_gtp_remat",
}
_GLOO_KINDS = ("dp-cp", "intra-dp-cp", "dp", "expt-dp", "intra-expt-dp")
# With one distributed-optimizer instance the partial groups ARE the full ones (as in 0.16).
_PARTIAL_OF = {"intra-dp-cp": "dp-cp", "intra-expt-dp": "expt-dp"}
_SHARP_KIND = {"dp": "dp-cp", "dp_replica": "inter-dist-opt"}


def _is_nccl(backend: str | None) -> bool:
    """``backend`` (default: the default group's) puts NCCL on CUDA tensors."""
    return device.backend_uses_cuda(backend or dist.get_backend())


def create_groups(state, layout: dict[str, list[list[int]]], options, sizes) -> None:
    """Create every group of ``layout`` on every rank; fill ``state`` with this rank's groups.

    Kinds whose rank lists coincide (e.g. "dp" and "dp-cp" when cp == 1) share one ProcessGroup,
    except where megatron-core needs a separate communicator (the all-gather group).
    """
    if _is_nccl(None) and "NCCL_COLLNET_ENABLE" in os.environ:
        del os.environ["NCCL_COLLNET_ENABLE"]  # SHARP only where asked (see module doc)
    extra = [k for k in layout if k.startswith(("hcp-", "hybrid-dp-cp-"))]
    for kind in list(_NCCL_NAMES) + extra:
        if kind not in layout:
            continue
        if kind in _PARTIAL_OF and options.num_distributed_optimizer_instances == 1:
            _alias(state, kind, _PARTIAL_OF[kind])
            continue
        sharp = options.sharp_enabled_group and _SHARP_KIND[options.sharp_enabled_group] == kind
        sharp = sharp and _is_nccl(None)  # no effect on gloo (NOTE [ NCCL-only options ])
        if sharp:
            os.environ["NCCL_COLLNET_ENABLE"] = "1"
        backend = options.pp_backend if kind == "pp" else None
        if backend == "ucc":
            _ucc_environment()
        for ranks in layout[kind]:
            group = _group(ranks, kind, options, backend, tag="sharp" if sharp else "")
            if state.global_rank in ranks:
                state.ranks[kind], state.groups[kind] = list(ranks), group
        if sharp:
            _initialize_sharp(state, kind)
        if kind == "dp-cp" and options.all_gather_group:
            for ranks in layout[kind]:
                group = _group(ranks, kind, options, None, tag="all-gather")
                if state.global_rank in ranks:
                    state.ranks["dp-cp-ag"], state.groups["dp-cp-ag"] = list(ranks), group
        if kind in _GLOO_KINDS and options.gloo:
            _create_gloo(state, layout, kind, options)
    if "expt-dp" in state.groups:  # not on a rank outside rank_offset + local_world_size
        state.ranks["dp-modulo-ep"] = state.ranks["expt-dp"]
        state.groups["dp-modulo-ep"] = state.groups["expt-dp"]
    levels = sorted(k for k in extra if k.startswith("hcp-") and k in state.groups)
    if levels:
        state.hierarchical_cp_groups = [state.groups[k] for k in levels]
    for kind in extra:
        if kind.startswith("hybrid-dp-cp-") and kind in state.groups:
            state.hybrid_dp_cp_groups[int(kind.rsplit("-", 1)[1])] = state.groups[kind]


def _ucc_environment() -> None:
    """UCC settings megatron-core 0.16 makes before creating UCC pipeline groups.

    Non-blocking waits, driver stream tasks and InfiniBand + CUDA copies unless set already;
    rendezvous from the first byte, all network devices, no SHARP/NCCL inside UCC's basic layer.
    """
    os.environ.setdefault("TORCH_UCC_BLOCKING_WAIT", "none")
    os.environ.setdefault("UCC_EC_CUDA_STREAM_TASK_MODE", "driver")
    os.environ.setdefault("UCX_TLS", "ib,cuda_copy")
    os.environ.update(
        NSYS_UCP_COMM_PARAMS="1",
        UCX_RNDV_THRESH="0",
        UCX_NET_DEVICES="all",
        UCC_CL_BASIC_TLS="^sharp,nccl",
    )


def _alias(state, kind: str, full: str) -> None:
    if full not in state.groups:  # a rank outside rank_offset + local_world_size
        return
    state.ranks[kind], state.groups[kind] = state.ranks[full], state.groups[full]
    if full in state.gloo_groups:
        state.gloo_groups[kind] = state.gloo_groups[full]


def _group(ranks, kind, options, backend, tag=""):
    name = _NCCL_NAMES.get(kind, "hcp" if kind.startswith("hcp-") else "dp_cp")
    pg_options, options_key = None, ()
    if _is_nccl(backend) and backend != "ucc" and name in options.nccl_comm_cfgs:
        pg_options = get_nccl_options(name, options.nccl_comm_cfgs)
        options_key = tuple(sorted(options.nccl_comm_cfgs[name].items()))
    return cached_group(
        ranks,
        options.timeout,
        backend=backend,
        options_key=options_key,
        pg_options=pg_options,
        tag=tag,
        group_desc=kind.upper().replace("-", "_"),
    )


def _create_gloo(state, layout, kind, options) -> None:
    # On a gloo world the data-parallel groups already are gloo groups: reuse them.
    backend = None if dist.get_backend() == "gloo" else "gloo"
    for ranks in layout[kind]:
        group = cached_group(ranks, options.timeout, backend=backend, group_desc=f"{kind}_GLOO")
        if state.global_rank in ranks:
            state.gloo_groups[kind] = group


def _initialize_sharp(state, kind: str) -> None:
    """NCCL creates communicators lazily: run a barrier so SHARP's one group really is this one."""
    group = state.groups.get(kind)
    if group is not None:
        dist.barrier(group=group, device_ids=[device.current_device().index])
        device.synchronize()
    del os.environ["NCCL_COLLNET_ENABLE"]
