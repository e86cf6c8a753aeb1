"""Validate initialize_model_parallel's sizes and compute every group of every kind (pure logic).

Step one and two of set-up (validate -> layout -> create groups); no torch.distributed here, so
every rank raises the same error for the same bad input before any collective runs. The grids
follow NOTE [ Rank layout ] in megatron_core/parallel_state/__init__.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.rank_generator import (
    RankGenerator,
    default_embedding_ranks,
    default_position_embedding_ranks,
    hierarchical_rank_groups,
    hybrid_dp_cp_rank_groups,
    split_rank_embedding_rules,
)

__all__ = ["ParallelSizes", "validate_sizes", "layout_of", "compute_rank_layout"]

# Group kinds read straight from a grid: kind -> (grid, token). See NOTE [ Rank layout ], rule 4.
_GRID_KINDS = {
    "dp-cp": ("dense", "dp-cp"),
    "dp": ("dense", "dp"),
    "cp": ("dense", "cp"),
    "mp": ("dense", "tp-pp"),
    "tp": ("dense", "tp"),
    "pp": ("dense", "pp"),
    "tp-dp-cp": ("dense", "tp-dp-cp"),
    "tp-dp": ("dense", "tp-dp"),
    "tp-cp": ("dense", "tp-cp"),
    "ep": ("expert", "ep"),
    "expt-tp": ("expert", "tp"),
    "tp-ep": ("expert", "tp-ep"),
    "tp-ep-pp": ("expert", "tp-ep-pp"),
    "expt-dp": ("expert", "dp"),
}


@dataclass(frozen=True)
class ParallelSizes:
    """Validated degrees of one initialize_model_parallel call.

    ``dp`` = world / (tp * pp * cp); ``expert_dp`` = world / (etp * ep * pp) (cp folded in).
    """

    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    expert_dp: int
    order: str
    num_distributed_optimizer_instances: int = 1
    rank_offset: int = 0

    def dense_grid(self) -> RankGenerator:
        """The dense grid: tp, cp, dp, pp (rule 4)."""
        return RankGenerator(self.tp, 1, self.dp, self.pp, self.cp, self.order, self.rank_offset)

    def expert_grid(self) -> RankGenerator:
        """The expert grid: etp on the tp slot, ep, expert-dp on the dp slot, pp (rule 4)."""
        return RankGenerator(
            self.etp, self.ep, self.expert_dp, self.pp, 1, self.order, self.rank_offset
        )


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MegatronCoreError(f"{name} ({value!r}) must be an integer >= 1")


def validate_sizes(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    order: str = "tp-cp-ep-dp-pp",
    num_distributed_optimizer_instances: int = 1,
    rank_offset: int = 0,
) -> ParallelSizes:
    """Check every size and divisibility rule of megatron-core 0.16; return the derived degrees.

    ``world_size`` is the number of ranks the grids cover, from global rank ``rank_offset`` on
    (megatron-core 0.17's ``local_world_size`` and ``rank_offset``).

    Raises:
        MegatronCoreError: naming the value and the rule that failed.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep, n_opt = expert_model_parallel_size, num_distributed_optimizer_instances
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
        ("num_distributed_optimizer_instances", n_opt),
    ):
        _positive_int(name, value)
    if world_size % (tp * pp * cp):
        raise MegatronCoreError(
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) x "
            f"context_parallel_size ({cp}) = {tp * pp * cp} must divide world size ({world_size})"
        )
    if world_size % (etp * ep * pp):
        raise MegatronCoreError(
            f"expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) x "
            f"pipeline_model_parallel_size ({pp}) = {etp * ep * pp} must divide world size "
            f"({world_size})"
        )
    dp, expert_dp = world_size // (tp * pp * cp), world_size // (etp * ep * pp)
    if (dp * cp) % n_opt:
        raise MegatronCoreError(
            f"num_distributed_optimizer_instances ({n_opt}) must divide the data x context "
            f"parallel size ({dp * cp})"
        )
    if expert_dp % n_opt:
        raise MegatronCoreError(
            f"num_distributed_optimizer_instances ({n_opt}) must divide the expert data "
            f"parallel size ({expert_dp} = world {world_size} / (etp {etp} x ep {ep} x pp {pp}))"
        )
    sizes = ParallelSizes(world_size, tp, pp, cp, dp, ep, etp, expert_dp, order, n_opt, rank_offset)
    dense, expert = sizes.dense_grid(), sizes.expert_grid()  # validates the order string
    # The caller's order, as megatron-core checks it: the grids' normalized orders have the
    # omitted size-1 axes appended ("tp-ep-dp-pp" becomes "tp-ep-dp-pp-cp").
    if not (order.endswith("pp") or pp == 1 or expert_dp == dp):
        raise MegatronCoreError(
            f"order ({order!r}) does not end in 'pp', so with pipeline_model_parallel_size ({pp}) "
            f"> 1 the expert data parallel size ({expert_dp}) must equal the data parallel size "
            f"({dp})"
        )
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise MegatronCoreError(
            f"pipeline groups differ between the dense grid {dense.get_ranks('pp')} and the "
            f"expert grid {expert.get_ranks('pp')} for order ({order!r}); use an order ending "
            f"in 'pp'"
        )
    return sizes


EmbeddingRule = Callable[[list[int]], list[int]]


def layout_of(
    sizes: ParallelSizes,
    get_embedding_ranks: EmbeddingRule | None = None,
    get_position_embedding_ranks: EmbeddingRule | None = None,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
) -> dict[str, list[list[int]]]:
    """Every group of every kind, in the order initialize_model_parallel creates them.

    Kinds: the grid kinds ("dp-cp", "dp", "cp", "mp", "tp", "pp", "tp-dp-cp", "tp-dp", "tp-cp",
    "ep", "expt-tp", "tp-ep", "tp-ep-pp", "expt-dp"), "embedding", "position_embedding",
    "intra-dp-cp", "intra-expt-dp", "intra-dist-opt", "inter-dist-opt" (only with more than one
    distributed-optimizer instance), "hcp-<level>" (hierarchical context parallel) and
    "hybrid-dp-cp-<size>" (hybrid context parallel), "gtp-remat" / "expt-gtp-remat" (megatron-core
    0.19's weight-remat groups: one rank each, as the remat size is 1). "dp-modulo-ep" names
    "expt-dp" (the older megatron-core name).
    """
    grids = {"dense": sizes.dense_grid(), "expert": sizes.expert_grid()}
    layout = {kind: grids[g].get_ranks(token) for kind, (g, token) in _GRID_KINDS.items()}
    layout["gtp-remat"] = grids["dense"].get_gtp_ranks(1)
    layout["expt-gtp-remat"] = grids["expert"].get_gtp_ranks(1)
    embedding = get_embedding_ranks or default_embedding_ranks
    position = get_position_embedding_ranks or default_position_embedding_ranks
    layout["embedding"] = [
        _checked_rule(embedding(p), p, "get_embedding_ranks") for p in layout["pp"]
    ]
    layout["position_embedding"] = [
        _checked_rule(position(p), p, "get_position_embedding_ranks") for p in layout["pp"]
    ]
    n_opt = sizes.num_distributed_optimizer_instances
    layout["intra-dp-cp"] = [c for g in layout["dp-cp"] for c in _chunks(g, len(g) // n_opt)]
    intra_expt = sizes.expert_dp // n_opt
    layout["intra-expt-dp"] = [c for g in layout["expt-dp"] for c in _chunks(g, intra_expt)]
    if n_opt > 1:
        layout["inter-dist-opt"] = [
            inter
            for g in layout["expt-dp"]
            for inter in hierarchical_rank_groups(g, [intra_expt, n_opt])[1]
        ]
    tep = layout["tp-ep-pp"]
    layout["intra-dist-opt"] = [
        [r for g in tep[i : i + intra_expt] for r in g] for i in range(0, len(tep), intra_expt)
    ]
    if hierarchical_context_parallel_sizes:
        if math.prod(hierarchical_context_parallel_sizes) != sizes.cp:
            raise MegatronCoreError(
                f"hierarchical_context_parallel_sizes ({list(hierarchical_context_parallel_sizes)})"
                f" must multiply to context_parallel_size ({sizes.cp})"
            )
        per_cp = [
            hierarchical_rank_groups(g, hierarchical_context_parallel_sizes) for g in layout["cp"]
        ]
        for level in range(len(hierarchical_context_parallel_sizes)):
            layout[f"hcp-{level}"] = [g for levels in per_cp for g in levels[level]]
    if hybrid_context_parallel:
        if (sizes.dp * sizes.cp) % 2:
            raise MegatronCoreError(
                f"hybrid_context_parallel needs an even data x context parallel size "
                f"({sizes.dp * sizes.cp})"
            )
        for group in layout["dp-cp"]:
            for size, chunks in hybrid_dp_cp_rank_groups(group).items():
                layout.setdefault(f"hybrid-dp-cp-{size}", []).extend(chunks)
    layout["dp-modulo-ep"] = layout["expt-dp"]
    return layout


def _chunks(ranks: list[int], size: int) -> list[list[int]]:
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def _checked_rule(ranks, pp_ranks: list[int], name: str) -> list[int]:
    if not isinstance(ranks, (list, tuple)) or not ranks or any(r not in pp_ranks for r in ranks):
        raise MegatronCoreError(
            f"{name} returned {ranks!r} for pipeline group {pp_ranks}: it must return a non-empty "
            f"list of ranks from that pipeline group"
        )
    return list(ranks)


def compute_rank_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    pipeline_model_parallel_split_rank: int | None = None,
    *,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    get_embedding_ranks: EmbeddingRule | None = None,
    get_position_embedding_ranks: EmbeddingRule | None = None,
) -> dict[str, list[list[int]]]:
    """Every group of every kind for a world size, without touching torch.distributed.

    The same layout initialize_model_parallel builds (see :func:`layout_of` for the kinds).
    Example: ``compute_rank_layout(8, context_parallel_size=2, expert_model_parallel_size=2)["ep"]``
    is ``[[0, 1], [2, 3], [4, 5], [6, 7]]``, as in megatron-core 0.16.

    Raises:
        MegatronCoreError: for any invalid size, order or split rank (messages name the values).
    """
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
    get_embedding_ranks, get_position_embedding_ranks = embedding_rules(
        sizes.pp,
        pipeline_model_parallel_split_rank,
        get_embedding_ranks,
        get_position_embedding_ranks,
    )
    return layout_of(
        sizes,
        get_embedding_ranks,
        get_position_embedding_ranks,
        hierarchical_context_parallel_sizes,
        hybrid_context_parallel,
    )


def embedding_rules(
    pp: int,
    split_rank: int | None,
    get_embedding_ranks: EmbeddingRule | None,
    get_position_embedding_ranks: EmbeddingRule | None,
) -> tuple[EmbeddingRule | None, EmbeddingRule | None]:
    """The embedding rules to use: the given ones, or the split-rank rules (an extension)."""
    if split_rank is None:
        return get_embedding_ranks, get_position_embedding_ranks
    if get_embedding_ranks is not None or get_position_embedding_ranks is not None:
        raise MegatronCoreError(
            "pipeline_model_parallel_split_rank and get_embedding_ranks / "
            "get_position_embedding_ranks are exclusive: give one or the other"
        )
    if not isinstance(split_rank, int) or isinstance(split_rank, bool) or not 0 <= split_rank < pp:
        raise MegatronCoreError(
            f"pipeline_model_parallel_split_rank ({split_rank!r}) must be in "
            f"[0, pipeline_model_parallel_size ({pp}))"
        )
    return split_rank_embedding_rules(split_rank)
