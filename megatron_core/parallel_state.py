"""Process groups for tensor / pipeline / data / context / expert parallelism.

Drop-in for megatron-core 0.16's ``parallel_state``: every public function, same parameters and
defaults, same rank layout (NOTE [ Rank layout ] in megatron_core/rank_grid.py). All state lives
in one :class:`ParallelState` object that always exists: ``initialize_model_parallel`` fills it,
the ``set_*`` functions override sizes and ranks in it, ``destroy_model_parallel`` empties it. The
getters (megatron_core/_parallel_getters*.py, re-exported here) read it and raise
:class:`~megatron_core.errors.MegatronCoreError` (an ``AssertionError`` too) where megatron-core
asserts.

Set-up runs in short steps: validate the arguments and compute the layout of both rank grids
(locally, no collective) -> agree over WORLD that every rank got the same arguments and the same
outcome, so a rank whose arguments are invalid or differ makes every rank raise instead of
leaving its peers waiting (:func:`_check_arguments_agree`) -> create the groups.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_core import consistency
from megatron_core._parallel_layout import (
    ParallelSizes,
    compute_rank_layout,
    embedding_rules,
    layout_of,
    validate_sizes,
)
from megatron_core._parallel_setup import create_groups, validated_options
from megatron_core._process_groups import (
    create_group,
    create_hierarchical_groups,
    create_hybrid_dp_cp_groups,
    get_nccl_options,
    overwrite_nccl_comm_cfgs,
    reset_process_group_list,
    update_pg_timeout,
)
from megatron_core.errors import MegatronCoreError
from megatron_core.rank_grid import (
    RankGenerator,
    default_embedding_ranks,
    default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups,
)
from megatron_core.utils import GlobalMemoryBuffer

__all__ = [
    "ParallelState",
    "get_parallel_state",
    "compute_rank_layout",
    "RankGenerator",
    "generate_masked_orthogonal_rank_groups",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "get_nccl_options",
    "overwrite_nccl_comm_cfgs",
    "update_pg_timeout",
    "create_group",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
    "initialize_model_parallel",
    "is_initialized",
    "is_unitialized",
    "model_parallel_is_initialized",
    "destroy_model_parallel",
    "get_global_memory_buffer",
    "get_global_symmetric_memory_buffer",
    "destroy_global_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
]

logger = logging.getLogger(__name__)


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


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
    *,
    pipeline_model_parallel_split_rank: int | None = None,
) -> None:
    """Create every model-parallel process group from the two rank grids (megatron-core 0.16).

    The data-parallel size is ``world / (tp * pp * cp)``; experts use a second grid with
    ``expert_tensor_parallel_size`` (etp, default tp), ep, expert-dp = ``world / (etp * ep * pp)``
    and pp (NOTE [ Rank layout ], rule 4). Every rank must call this with the same arguments; all
    groups are created collectively in the same order on every rank. Validation happens before
    any collective, so bad arguments raise the same MegatronCoreError on every rank.

    Example (NOTE [ Rank layout ]): 8 ranks with tp=2, pp=2 give tensor groups [0,1] [2,3] [4,5]
    [6,7], data groups [0,2] [1,3] [4,6] [5,7], pipeline groups [0,4] [1,5] [2,6] [3,7].

    Args:
        tensor_model_parallel_size: ranks that split each layer's weights.
        pipeline_model_parallel_size: pipeline stages.
        virtual_pipeline_model_parallel_size: model chunks per stage (interleaved schedule);
            requires pipeline_model_parallel_size > 1.
        pipeline_model_parallel_comm_backend: backend of the pipeline groups: None (the default
            backend), "nccl" or "ucc" (NOTE [ NCCL-only options ], rule 4).
        use_sharp: NCCL SHARP for the group named by ``sharp_enabled_group`` ("dp", the default,
            or "dp_replica"). NCCL only; no effect on gloo (NOTE [ NCCL-only options ]).
        context_parallel_size: ranks that split the sequence for attention.
        hierarchical_context_parallel_sizes: split each context-parallel group into levels of
            these sizes (product = cp); see get_hierarchical_context_parallel_groups.
        hybrid_context_parallel: also create data x context groups of sizes 2, 4, ... below dp*cp.
        expert_model_parallel_size: ranks that split the experts of MoE layers.
        num_distributed_optimizer_instances: distributed-optimizer replicas across the data x
            context domain (partial and inter-instance groups).
        expert_tensor_parallel_size: ranks that split each expert's weights (default tp).
        nccl_communicator_config_path: yaml file ``{group name: {min_ctas, max_ctas,
            cga_cluster_size, net_name, is_high_priority_stream}}`` (needs PyYAML). Validated on
            every backend, applied to NCCL groups only.
        distributed_timeout_minutes: timeout of the created groups.
        order: grid axis order, fastest-varying first ("tp-cp-ep-dp-pp" or e.g. "tp-pp-dp").
        get_embedding_ranks: pipeline group -> ranks holding the word embedding (default first
            and last stage).
        get_position_embedding_ranks: pipeline group -> ranks holding the position embedding
            (default first stage).
        create_gloo_process_groups: also create gloo data-parallel groups (reused as-is when the
            default backend already is gloo).
        high_priority_stream_groups: group names ("dp_cp", "ep_dp", ...) whose NCCL communicators
            use high-priority streams. No effect on gloo.
        sharp_enabled_group: see ``use_sharp``; must be None without it.
        create_all_gather_group: also create a second data x context group over the same ranks,
            for all-gathers that should not queue behind reduce-scatters.
        pipeline_model_parallel_split_rank: (extension, keyword only) encoder/decoder split
            stage; it joins the embedding groups. Exclusive with get_embedding_ranks.

    Raises:
        MegatronCoreError: torch.distributed not initialized, already initialized, or a bad value.
    """
    arguments = dict(locals())
    if not (dist.is_available() and dist.is_initialized()):
        raise MegatronCoreError(
            "initialize_model_parallel needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first"
        )
    world_size = dist.get_world_size()
    # Validation is local, but its outcome is agreed over WORLD before anything else: a rank
    # whose arguments are invalid must not leave the others waiting (issue 15, point 2).
    error, sizes, layout, options = None, None, None, None
    try:
        if _STATE.initialized:
            raise MegatronCoreError(
                "initialize_model_parallel called twice: call destroy_model_parallel() first"
            )
        sizes = validate_sizes(
            world_size,
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            context_parallel_size,
            expert_model_parallel_size,
            expert_tensor_parallel_size,
            order,
            num_distributed_optimizer_instances,
        )
        _validate_virtual_pipeline(
            virtual_pipeline_model_parallel_size, pipeline_model_parallel_size
        )
        options = validated_options(arguments)
        rules = embedding_rules(
            sizes.pp,
            pipeline_model_parallel_split_rank,
            get_embedding_ranks,
            get_position_embedding_ranks,
        )
        layout = layout_of(
            sizes, *rules, hierarchical_context_parallel_sizes, bool(hybrid_context_parallel)
        )
    except Exception as exc:  # agreed below, then re-raised on every rank
        error = exc
    _check_arguments_agree(arguments, layout, error)
    state = ParallelState(
        global_rank=dist.get_rank(),
        world_size=world_size,
        overrides=_STATE.overrides,
        # Without the argument, a size set earlier by the setters stays (as in megatron-core).
        virtual_pipeline_model_parallel_size=(
            _STATE.virtual_pipeline_model_parallel_size
            if virtual_pipeline_model_parallel_size is None
            else virtual_pipeline_model_parallel_size
        ),
        virtual_pipeline_model_parallel_rank=(
            _STATE.virtual_pipeline_model_parallel_rank
            if virtual_pipeline_model_parallel_size is None
            else 0
        ),
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
    )
    create_groups(state, layout, options, sizes)
    state.memory_buffer = GlobalMemoryBuffer()
    state.sizes = sizes
    _replace_state(state)


def _replace_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def _validate_virtual_pipeline(vpp, pp) -> None:
    if vpp is None:
        return
    if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1 or pp < 2:
        raise MegatronCoreError(
            f"virtual_pipeline_model_parallel_size ({vpp!r}) must be an integer >= 1 and needs "
            f"pipeline_model_parallel_size ({pp}) > 1 (interleaved schedule)"
        )


def _check_arguments_agree(arguments: dict, layout: dict | None, error: Exception | None) -> None:
    """Every rank must pass the same arguments to initialize_model_parallel (issue 15).

    Runs after the local validation and layout (nothing collective yet) and before the first
    group is created. A rank that disagrees would build other groups and hang the others in
    new_group; here every rank raises instead. ``arguments`` holds the call's arguments by name,
    ``layout`` what they resolved to (None if this rank's validation raised ``error``).

    One agreement over WORLD (megatron_core.consistency.agree: a 16-int64 all-gather), always
    on: a group-cache hit in create_groups must never hide a disagreement. Callables (the
    embedding-rank rules) are compared by name, the resolved layout by a digest, and a rank
    whose validation failed contributes its error message instead. So: arguments that differ
    -> a RankDisagreementError on every rank naming each rank's values; the same invalid
    arguments everywhere -> every rank re-raises its (identical) validation error; a rank that
    failed alone -> a RankDisagreementError carrying its message, on every rank.
    """
    if error is not None:
        outcome = f"invalid: {type(error).__name__}: {error}"
    else:
        outcome = hashlib.blake2b(repr(sorted(layout.items())).encode(), digest_size=6).hexdigest()
    comparable = {
        name: f"{value.__module__}.{value.__qualname__}" if callable(value) else value
        for name, value in arguments.items()
    }
    consistency.agree("initialize_model_parallel", dist.group.WORLD, layout=outcome, **comparable)
    if error is not None:
        raise error


def destroy_model_parallel() -> None:
    """Drop the model-parallel state, overrides and buffers (idempotent).

    As in megatron-core, the process groups themselves are not destroyed: a later
    initialize_model_parallel with the same layout reuses them, and
    ``torch.distributed.destroy_process_group()`` releases everything. Getters raise again
    until re-initialized.
    """
    reset_process_group_list()
    _replace_state(ParallelState())


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


# Getters with megatron-core's names live in sibling modules to keep this one short; they are
# re-exported here so `parallel_state.get_tensor_model_parallel_rank()` works as in megatron-core.
from megatron_core._parallel_getters import *  # noqa: E402, F403
from megatron_core._parallel_getters import __all__ as _getter_names  # noqa: E402
from megatron_core._parallel_getters_expert import *  # noqa: E402, F403
from megatron_core._parallel_getters_expert import __all__ as _expert_names  # noqa: E402
from megatron_core._parallel_getters_pipeline import *  # noqa: E402, F403
from megatron_core._parallel_getters_pipeline import __all__ as _pipeline_names  # noqa: E402

__all__ += _getter_names + _pipeline_names + _expert_names
