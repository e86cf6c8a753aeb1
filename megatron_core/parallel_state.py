"""Process groups for tensor / pipeline / data / context / expert parallelism.

Megatron-compatible: ``initialize_model_parallel`` and the getters keep megatron-core's names,
signatures and rank layout (see NOTE [ Rank layout ] in megatron_core/rank_grid.py). All state
lives in one :class:`ParallelState` object; the module-level getters read it and raise
:class:`~megatron_core.errors.MegatronCoreError` before initialization.

Set-up runs in three short steps: validate the arguments (no collective yet, so every rank raises
the same error) -> compute the rank layout from one :class:`RankGrid` -> create the groups.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.rank_grid import RankGrid, embedding_ranks

__all__ = [
    "ParallelState",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "destroy_model_parallel",
    "get_parallel_state",
    "compute_rank_layout",
]

# Group kinds and how they are read from the grid: kind -> (grid kind, independent_ep).
_GRID_KINDS = {
    "tp": ("tp", False),
    "pp": ("pp", False),
    "dp": ("dp", False),
    "dp-cp": ("dp-cp", False),
    "cp": ("cp", False),
    "mp": ("tp-pp", False),
    "tp-cp": ("tp-cp", False),
    "tp-dp": ("tp-dp", False),
    "tp-dp-cp": ("tp-dp-cp", False),
    "ep": ("ep", True),
    "tp-ep": ("tp-ep", True),
    "dp-modulo-ep": ("dp", True),
    "dp-cp-modulo-ep": ("dp-cp", True),
}


def compute_rank_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    pipeline_model_parallel_split_rank: int | None = None,
) -> dict[str, list[list[int]]]:
    """Every group of every kind for a world size, without touching torch.distributed.

    Kinds: "tp", "pp", "dp", "dp-cp", "cp", "mp" (tp x pp), "tp-cp", "tp-dp", "tp-dp-cp", "ep",
    "tp-ep", "dp-modulo-ep", "dp-cp-modulo-ep", "embedding", "position_embedding".

    Raises:
        MegatronCoreError: for any invalid size, order or split rank (messages name the values).
    """
    grid = _validated_grid(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        order,
    )
    return _layout_of(grid, pipeline_model_parallel_split_rank)


def _layout_of(grid: RankGrid, split_rank: int | None) -> dict[str, list[list[int]]]:
    if split_rank is not None and not (0 <= split_rank < grid.pp):
        raise MegatronCoreError(
            f"pipeline_model_parallel_split_rank ({split_rank}) must be in "
            f"[0, pipeline_model_parallel_size ({grid.pp}))"
        )
    layout = {kind: grid.ranks(g, ep) for kind, (g, ep) in _GRID_KINDS.items()}
    pairs = [embedding_ranks(p, split_rank) for p in layout["pp"]]
    layout["embedding"] = [e for e, _ in pairs]
    layout["position_embedding"] = [p for _, p in pairs]
    return layout


def _validated_grid(world_size, tp, pp, cp, ep, order) -> RankGrid:
    sizes = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MegatronCoreError(f"{name} ({value!r}) must be an integer >= 1")
    model_size = tp * pp * cp
    if world_size % model_size:
        raise MegatronCoreError(
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) x "
            f"context_parallel_size ({cp}) = {model_size} must divide world size ({world_size})"
        )
    dp = world_size // model_size
    if dp % ep:
        raise MegatronCoreError(
            f"expert_model_parallel_size ({ep}) must divide the data-parallel size ({dp}) "
            f"(world size {world_size} / (tp {tp} x pp {pp} x cp {cp}))"
        )
    return RankGrid(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, order=order)


@dataclass
class ParallelState:
    """All process-group state of this rank: one object, read by the module-level getters.

    Attributes:
        global_rank: this process's rank in the default (WORLD) group.
        world_size: size of the default group.
        grid: the validated rank grid.
        ranks: kind -> the global ranks of THIS rank's group of that kind (see compute_rank_layout).
        groups: kind -> the ProcessGroup of this rank's group of that kind.
        gloo_groups: kind -> a gloo ProcessGroup over the same ranks ("dp", "dp-cp"), if created.
        virtual_pipeline_model_parallel_size / _rank: interleaved-schedule state (None if unused).
        pipeline_model_parallel_split_rank: encoder/decoder split stage, or None.
    """

    global_rank: int
    world_size: int
    grid: RankGrid
    ranks: dict[str, list[int]] = field(default_factory=dict)
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    gloo_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    virtual_pipeline_model_parallel_size: int | None = None
    virtual_pipeline_model_parallel_rank: int | None = None
    pipeline_model_parallel_split_rank: int | None = None

    def group(self, kind: str) -> dist.ProcessGroup:
        """This rank's process group of ``kind``."""
        self._check_member(kind)
        return self.groups[kind]

    def rank_in(self, kind: str) -> int:
        """This rank's index inside its group of ``kind``."""
        self._check_member(kind)
        return self.ranks[kind].index(self.global_rank)

    def size_of(self, kind: str) -> int:
        """Number of ranks in this rank's group of ``kind``."""
        self._check_member(kind)
        return len(self.ranks[kind])

    def _check_member(self, kind: str) -> None:
        # Only embedding kinds leave ranks out (middle pipeline stages hold no embedding).
        if kind not in self.ranks:
            raise MegatronCoreError(
                f"global rank {self.global_rank} is in no {kind} group (only the first/last "
                f"pipeline stages and the split stage hold embeddings)"
            )


_STATE: ParallelState | None = None


def get_parallel_state() -> ParallelState:
    """The current ParallelState; raises MegatronCoreError before initialize_model_parallel."""
    if _STATE is None:
        raise MegatronCoreError(
            "model parallel state is not initialized: call "
            "megatron_core.parallel_state.initialize_model_parallel(...) first"
        )
    return _STATE


def model_parallel_is_initialized() -> bool:
    """True between initialize_model_parallel and destroy_model_parallel."""
    return _STATE is not None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_split_rank: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    create_gloo_process_groups: bool = True,
) -> None:
    """Create every model-parallel process group from one rank grid (megatron-core semantics).

    The data-parallel size is ``world_size / (tp * pp * cp)``; expert parallelism splits it
    (``ep`` must divide it). Every rank must call this with the same arguments; all groups are
    created collectively in the same order on every rank. Validation happens before any
    collective, so bad arguments raise the same MegatronCoreError on every rank.

    Example (NOTE [ Rank layout ]): 8 ranks with tp=2, pp=2 give tensor groups [0,1] [2,3] [4,5]
    [6,7], data groups [0,2] [1,3] [4,6] [5,7], pipeline groups [0,4] [1,5] [2,6] [3,7].

    Args:
        tensor_model_parallel_size: ranks that split each layer's weights.
        pipeline_model_parallel_size: pipeline stages.
        virtual_pipeline_model_parallel_size: model chunks per stage (interleaved schedule);
            requires pipeline_model_parallel_size > 1.
        pipeline_model_parallel_split_rank: stage where the decoder starts (encoder-decoder
            models); that stage joins the embedding groups.
        context_parallel_size: ranks that split the sequence for attention.
        expert_model_parallel_size: ranks that split the experts of MoE layers.
        distributed_timeout_minutes: timeout of the created groups.
        order: grid axis order, fastest-varying first ("tp-cp-ep-dp-pp" or e.g. "tp-pp-dp").
        create_gloo_process_groups: also create gloo data-parallel groups (reused as-is when the
            default backend already is gloo).

    Raises:
        MegatronCoreError: torch.distributed not initialized, already initialized, or a bad value.
    """
    global _STATE
    if not (dist.is_available() and dist.is_initialized()):
        raise MegatronCoreError(
            "initialize_model_parallel needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first"
        )
    if _STATE is not None:
        raise MegatronCoreError(
            "initialize_model_parallel called twice: call destroy_model_parallel() first"
        )
    world_size, global_rank = dist.get_world_size(), dist.get_rank()
    if virtual_pipeline_model_parallel_size is not None and (
        pipeline_model_parallel_size < 2 or virtual_pipeline_model_parallel_size < 1
    ):
        raise MegatronCoreError(
            f"virtual_pipeline_model_parallel_size ({virtual_pipeline_model_parallel_size}) "
            f"must be >= 1 and needs pipeline_model_parallel_size "
            f"({pipeline_model_parallel_size}) > 1 (interleaved schedule)"
        )
    grid = _validated_grid(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        order,
    )
    layout = _layout_of(grid, pipeline_model_parallel_split_rank)
    state = ParallelState(
        global_rank=global_rank,
        world_size=world_size,
        grid=grid,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_rank=(
            0 if virtual_pipeline_model_parallel_size is not None else None
        ),
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
    )
    _create_groups(state, layout, distributed_timeout_minutes, create_gloo_process_groups)
    _STATE = state


# Process groups outlive the ParallelState that asked for them: (ranks, backend, timeout) -> group,
# valid while the default (WORLD) group it was created under is alive. See _new_group.
_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}
_GROUP_CACHE_WORLD: list = [None]


def _new_group(ranks: list[int], timeout: datetime.timedelta, backend: str | None = None):
    """``dist.new_group`` with reuse: a later initialize with the same ranks gets the same group.

    Like megatron-core, destroy_model_parallel drops the state but does not tear communicators
    down; re-initializing then costs no new connections (creating and shutting down gloo pairs
    over and over is slow and, on a loaded machine, was seen to fail in connectFullMesh). Every
    rank calls this for every group in the same order, so every rank hits or misses alike.
    """
    world = dist.group.WORLD
    if _GROUP_CACHE_WORLD[0] is not world:  # torch.distributed was re-initialized
        _GROUP_CACHE.clear()
        _GROUP_CACHE_WORLD[0] = world
    key = (tuple(ranks), backend, timeout)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(ranks=list(ranks), timeout=timeout, backend=backend)
    return _GROUP_CACHE[key]


def _create_groups(
    state: ParallelState, layout: dict[str, list[list[int]]], timeout_minutes: int, gloo: bool
) -> None:
    """Create the groups of every kind on every rank, same order everywhere; keep this rank's.

    Kinds whose rank lists coincide (e.g. "dp" and "dp-cp" when cp == 1) share one ProcessGroup.
    """
    timeout = datetime.timedelta(minutes=timeout_minutes)
    for kind, groups in layout.items():
        for ranks in groups:
            pg = _new_group(ranks, timeout)
            if state.global_rank in ranks:
                state.ranks[kind] = list(ranks)
                state.groups[kind] = pg
    if not gloo:
        return
    backend = None if dist.get_backend() == "gloo" else "gloo"  # reuse the groups on gloo
    for kind in ("dp", "dp-cp"):
        for ranks in layout[kind]:
            pg = _new_group(ranks, timeout, backend)
            if state.global_rank in ranks:
                state.gloo_groups[kind] = pg


def destroy_model_parallel() -> None:
    """Drop the model-parallel state (idempotent); getters raise again until re-initialized.

    As in megatron-core, the process groups themselves are not destroyed: a later
    initialize_model_parallel with the same layout reuses them, and
    ``torch.distributed.destroy_process_group()`` releases everything.
    """
    global _STATE
    _STATE = None


# Getters with megatron-core's names live in a sibling module to keep this one short; they are
# re-exported here so `parallel_state.get_tensor_model_parallel_rank()` works as in megatron-core.
from megatron_core._parallel_getters import *  # noqa: E402, F403
from megatron_core._parallel_getters import __all__ as _getter_names  # noqa: E402

__all__ += _getter_names
