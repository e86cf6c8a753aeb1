"""The one state object of parallel_state: :class:`ParallelState` and its accessors.

Everything parallel_state knows about this rank (sizes, the global ranks and process group of each
kind, the ``set_*`` overrides, the interleaved-schedule state, the global buffers) lives in one
:class:`ParallelState` that always exists. :func:`initialize_model_parallel` (initialize.py)
builds a new one and installs it with :func:`_replace_state`; ``destroy_model_parallel`` installs
an empty one; the getters (getters_*.py) read it through :func:`_state`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.layout import ParallelSizes
from megatron_core.parallel_state.memory_buffer import GlobalMemoryBuffer

__all__ = [
    "ParallelState",
    "get_parallel_state",
    "is_initialized",
    "is_unitialized",
    "model_parallel_is_initialized",
    "get_global_memory_buffer",
    "get_global_symmetric_memory_buffer",
    "destroy_global_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
]


@dataclass
class ParallelState:
    """All process-group state of this rank: one object, read by the module-level getters.

    Attributes:
        global_rank / world_size: this process in the default (WORLD) group (None before init).
        sizes: the validated degrees (tp, pp, cp, dp, ep, etp, expert_dp, order, ...).
        ranks: kind -> the global ranks of THIS rank's group of that kind (kinds as in
            :func:`compute_rank_layout`; "dp-cp-ag" is the separate all-gather group).
        groups: kind -> the ProcessGroup of this rank's group of that kind.
        gloo_groups: kind -> a gloo group over the same ranks ("dp", "dp-cp", "intra-dp-cp",
            "expt-dp", "intra-expt-dp"), if created.
        hierarchical_cp_groups: this rank's group at each hierarchical context-parallel level.
        hybrid_dp_cp_groups: group size -> this rank's hybrid data x context group.
        overrides: values given to the ``set_*`` functions ("tp_size", "tp_rank", "pp_size",
            "pp_rank", "dp_size", "dp_rank", "ep_size", "ep_rank", "etp_size", "etp_rank");
            they win over the groups, before and after initialization.
        virtual_pipeline_model_parallel_size / _rank: interleaved-schedule state (None if unused).
        pipeline_model_parallel_split_rank: encoder/decoder split stage (an extension), or None.
        memory_buffer / symmetric_memory_buffer: the global buffers (see get_global_memory_buffer).
        assigned_globals: megatron-core module global name -> its value before the first
            assignment ``parallel_state._X = ...`` (NOTE [ Module globals ], module_globals.py).
    """

    global_rank: int | None = None
    world_size: int | None = None
    sizes: ParallelSizes | None = None
    ranks: dict[str, list[int]] = field(default_factory=dict)
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    gloo_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    hierarchical_cp_groups: list | None = None
    hybrid_dp_cp_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    overrides: dict[str, int] = field(default_factory=dict)
    virtual_pipeline_model_parallel_size: int | None = None
    virtual_pipeline_model_parallel_rank: int | None = None
    pipeline_model_parallel_split_rank: int | None = None
    memory_buffer: GlobalMemoryBuffer | None = None
    symmetric_memory_buffer: object | None = None
    assigned_globals: dict[str, object] = field(default_factory=dict)

    @property
    def initialized(self) -> bool:
        """True between initialize_model_parallel and destroy_model_parallel."""
        return self.sizes is not None

    def group(self, kind: str, check: bool = True) -> dist.ProcessGroup | None:
        """This rank's process group of ``kind``; None if ``check`` is False and there is none."""
        if kind not in self.groups:
            if not check:
                return None
            self._missing(kind)
        return self.groups[kind]

    def rank_in(self, kind: str) -> int:
        """This rank's index inside its group of ``kind`` (the group's own rank)."""
        return self.group(kind).rank()

    def size_of(self, kind: str) -> int:
        """Number of ranks in this rank's group of ``kind``."""
        return self.group(kind).size()

    def member_ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind``, in layout order."""
        self.group(kind)
        return self.ranks[kind]

    def _missing(self, kind: str) -> None:
        if not self.initialized:
            raise MegatronCoreError(
                f"{kind} group is not initialized: call "
                f"megatron_core.parallel_state.initialize_model_parallel(...) first"
            )
        reasons = {
            "embedding": "only the stages chosen by get_embedding_ranks hold the embedding",
            "position_embedding": "only the stages chosen by get_position_embedding_ranks hold it",
            "inter-dist-opt": "it exists only with num_distributed_optimizer_instances > 1",
            "dp-cp-ag": "initialize_model_parallel was called without create_all_gather_group",
        }
        raise MegatronCoreError(
            f"{kind} group is not initialized on global rank {self.global_rank}"
            + (f": {reasons[kind]}" if kind in reasons else "")
        )


_STATE = ParallelState()


def _state() -> ParallelState:
    """The one state object (initialized or not); getters and setters read and write it."""
    return _STATE


def get_parallel_state() -> ParallelState:
    """The current ParallelState; raises MegatronCoreError before initialize_model_parallel."""
    if not _STATE.initialized:
        raise MegatronCoreError(
            "model parallel state is not initialized: call "
            "megatron_core.parallel_state.initialize_model_parallel(...) first"
        )
    return _STATE


def is_initialized() -> bool:
    """True once initialize_model_parallel has built the groups (for code run with or without)."""
    return _STATE.initialized


def is_unitialized() -> bool:
    """Deprecated spelling of ``not is_initialized()`` (kept as megatron-core keeps it)."""
    warnings.warn(
        "is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2
    )
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    """True between initialize_model_parallel and destroy_model_parallel."""
    return _STATE.initialized


def _replace_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


# --- global memory buffers ---------------------------------------------------------------------


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The process-wide GlobalMemoryBuffer (created by initialize_model_parallel)."""
    if _STATE.memory_buffer is None:
        raise MegatronCoreError("global memory buffer is not initialized")
    return _STATE.memory_buffer


def get_global_symmetric_memory_buffer():
    """megatron-core's symmetric-memory buffer for inference: never created by this package."""
    if _STATE.symmetric_memory_buffer is None:
        raise MegatronCoreError(
            "global symmetric memory buffer is not initialized (megatron-core builds it for its "
            "NVLS inference collectives, which this package does not have)"
        )
    return _STATE.symmetric_memory_buffer


def destroy_global_memory_buffer() -> None:
    """Drop the global memory buffer (get_global_memory_buffer raises until re-initialized)."""
    _STATE.memory_buffer = None


def destroy_global_symmetric_memory_buffer() -> None:
    """Drop the global symmetric memory buffer."""
    _STATE.symmetric_memory_buffer = None
