"""Set-up and tear-down of parallel_state: initialize_model_parallel and destroy_model_parallel.

Set-up runs in short steps: validate the arguments and compute the layout of both rank grids
(layout.py; locally, no collective) -> agree over WORLD that every rank got the same arguments and
the same outcome, so a rank whose arguments are invalid or differ makes every rank raise instead of
leaving its peers waiting (:func:`_check_arguments_agree`) -> create the groups (create.py) ->
install the new :class:`~megatron_core.parallel_state.state.ParallelState`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import check_gtp_size
from megatron_core.parallel_state.agreement import agree_on_arguments
from megatron_core.parallel_state.create import create_groups, validated_options
from megatron_core.parallel_state.groups import reset_process_group_list
from megatron_core.parallel_state.layout import embedding_rules, layout_of, validate_sizes
from megatron_core.parallel_state.memory_buffer import GlobalMemoryBuffer
from megatron_core.parallel_state.state import ParallelState, _replace_state, _state

__all__ = ["initialize_model_parallel", "destroy_model_parallel"]

logger = logging.getLogger(__name__)


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
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    rank_offset: int = 0,
    local_world_size: int | None = None,
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
        gtp_remat_size, expert_gtp_remat_size: (megatron-core 0.19, keyword only here) the
            generalized-TP weight-remat sizes; only 1 is supported (ConfigError otherwise). The
            remat groups then hold one rank each (get_gtp_weight_remat_group).
        rank_offset, local_world_size: (megatron-core 0.17, keyword only here) lay the grids
            over global ranks ``rank_offset .. rank_offset + local_world_size - 1`` (default:
            from 0, the whole world). Every rank still calls this with the same arguments; a
            rank outside that range belongs to no model-parallel group.

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
    # whose arguments are invalid must not leave the others waiting (NOTE [ Agree before
    # acting ] in consistency/checks.py, rules 2 and 4).
    error, sizes, layout, options = None, None, None, None
    try:
        if _state().initialized:
            raise MegatronCoreError(
                "initialize_model_parallel called twice: call destroy_model_parallel() first"
            )
        check_gtp_size("gtp_remat_size", gtp_remat_size)
        check_gtp_size("expert_gtp_remat_size", expert_gtp_remat_size)
        sizes = validate_sizes(
            _local_world_size(world_size, rank_offset, local_world_size),
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            context_parallel_size,
            expert_model_parallel_size,
            expert_tensor_parallel_size,
            order,
            num_distributed_optimizer_instances,
            rank_offset,
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
        overrides=_state().overrides,
        # Without the argument, a size set earlier by the setters stays (as in megatron-core).
        virtual_pipeline_model_parallel_size=(
            _state().virtual_pipeline_model_parallel_size
            if virtual_pipeline_model_parallel_size is None
            else virtual_pipeline_model_parallel_size
        ),
        virtual_pipeline_model_parallel_rank=(
            _state().virtual_pipeline_model_parallel_rank
            if virtual_pipeline_model_parallel_size is None
            else 0
        ),
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
    )
    create_groups(state, layout, options, sizes)
    state.memory_buffer = GlobalMemoryBuffer()
    state.sizes = sizes
    _replace_state(state)


def _local_world_size(world_size: int, rank_offset, local_world_size) -> int:
    """The ranks the grids cover (megatron-core 0.17's rank_offset / local_world_size)."""
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
        raise MegatronCoreError(f"rank_offset ({rank_offset!r}) must be an integer >= 0")
    local = world_size - rank_offset if local_world_size is None else local_world_size
    if isinstance(local, bool) or not isinstance(local, int) or local < 1:
        raise MegatronCoreError(f"local_world_size ({local_world_size!r}) must be an integer >= 1")
    if rank_offset + local > world_size:
        raise MegatronCoreError(
            f"rank_offset ({rank_offset}) + local_world_size ({local}) exceeds the world size "
            f"({world_size})"
        )
    return local


def _validate_virtual_pipeline(vpp, pp) -> None:
    if vpp is None:
        return
    if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1 or pp < 2:
        raise MegatronCoreError(
            f"virtual_pipeline_model_parallel_size ({vpp!r}) must be an integer >= 1 and needs "
            f"pipeline_model_parallel_size ({pp}) > 1 (interleaved schedule)"
        )


def _check_arguments_agree(arguments: dict, layout: dict | None, error: Exception | None) -> None:
    """Every rank must pass the same arguments to initialize_model_parallel, or every rank raises.

    Runs after the local validation and layout (nothing collective yet) and before the first
    group is created. A rank that disagrees would build other groups and hang the others in
    new_group; here every rank raises instead. ``arguments`` holds the call's arguments by name,
    ``layout`` what they resolved to (None if this rank's validation raised ``error``).

    One agreement over WORLD (agreement.agree_on_arguments: a 16-int64 all-gather), always
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
        name: f"{value.__module__}.{value.__qualname__}" if callable(value) else repr(value)
        for name, value in arguments.items()
    }
    agree_on_arguments("initialize_model_parallel", {**comparable, "layout": repr(outcome)})
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
