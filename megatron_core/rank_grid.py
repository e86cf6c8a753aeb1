"""The rank grid: which global ranks form each process group (pure logic, no torch.distributed).

# NOTE [ Rank layout ]
#
# Every process group megatron_core creates comes from ONE grid of ranks, laid out exactly as
# megatron-core lays it, so a job ported from megatron-core puts the same ranks together.
#
# 1. The order string names the grid's axes from fastest- to slowest-varying: the default
#    "tp-cp-ep-dp-pp" means consecutive global ranks differ first in their tensor-parallel
#    coordinate, then context, (expert,) data and last pipeline. Axes missing from the string
#    must have size 1 and are appended at the end.
# 2. A global rank r has the coordinate  (r // stride_k) % size_k  on axis k, where stride_k is
#    the product of the sizes of the axes before k (a mixed-radix number, tp the lowest digit).
# 3. A group of kind "a-b" (e.g. "tp", "dp-cp", "tp-pp") holds the ranks that share every
#    coordinate EXCEPT those of axes a and b; inside the group, ranks are ordered by the masked
#    coordinates read as a mixed-radix number in grid order (megatron-core's "masked orthogonal
#    rank groups"). The model-parallel group is "tp-pp", the tensor+context group "tp-cp".
# 4. Expert parallelism is carved out of data parallelism: the data axis of size dp is split
#    into an expert axis of size ep (placed where "ep" sits in the order, which must be next to
#    "dp") and a data-modulo-expert axis of size dp // ep. Dense groups ("dp", "tp", ...) are
#    read from the grid WITHOUT the ep axis, expert groups ("ep", "tp-ep", data-modulo-expert)
#    from the grid WITH it. So ep must divide dp.
# 5. Embedding groups come from each pipeline group P: the word-embedding group is
#    [P[0], P[-1]] (first and last stage, which share the tied embedding), the position-
#    embedding group [P[0]]; with a pipeline split rank s, P[s] joins both. A one-stage
#    pipeline uses P itself for both.
#
# Worked example, 8 ranks, tp=2, pp=2 (so dp=2), order "tp-cp-ep-dp-pp":
#     axes (tp, dp, pp) with sizes (2, 2, 2) and strides (1, 2, 4)
#     tensor groups   [0, 1] [2, 3] [4, 5] [6, 7]       (vary tp)
#     data groups     [0, 2] [1, 3] [4, 6] [5, 7]       (vary dp)
#     pipeline groups [0, 4] [1, 5] [2, 6] [3, 7]       (vary pp)
#     model groups    [0, 1, 4, 5] [2, 3, 6, 7]        (vary tp and pp)
#     embedding groups = the pipeline groups (first and last stage of a 2-stage pipeline)
# tests/test_rank_grid.py checks this example and megatron-core's documented 16-rank one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_core.errors import MegatronCoreError

__all__ = ["AXES", "RankGrid", "generate_masked_orthogonal_rank_groups", "embedding_ranks"]

AXES = ("tp", "pp", "dp", "ep", "cp")


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """Group the ranks of a grid along the masked axes (NOTE [ Rank layout ], rules 2-3).

    Args:
        world_size: product of ``parallel_size``.
        parallel_size: size of each grid axis, fastest-varying first.
        mask: True for the axes that vary inside a group.

    Returns:
        ``world_size // prod(masked sizes)`` groups, each a list of global ranks; groups are ordered
        by their unmasked coordinates, ranks inside a group by their masked coordinates.
    """
    if math.prod(parallel_size) != world_size:
        raise MegatronCoreError(
            f"rank grid sizes {parallel_size} multiply to {math.prod(parallel_size)}, "
            f"not to world size ({world_size})"
        )
    strides = [math.prod(parallel_size[:k]) for k in range(len(parallel_size))]
    inner = [(s, d) for s, d, m in zip(parallel_size, strides, mask) if m]
    outer = [(s, d) for s, d, m in zip(parallel_size, strides, mask) if not m]

    def offsets(axes: list[tuple[int, int]]) -> list[int]:
        # All mixed-radix numbers over `axes`, first axis fastest: sum_k coord_k * stride_k.
        values = [0]
        for size, stride in axes:
            values = [v + c * stride for c in range(size) for v in values]
        return values

    return [[base + off for off in offsets(inner)] for base in offsets(outer)]


def _parse_order(order: str) -> list[str]:
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise MegatronCoreError(
            f"order ({order!r}) has unknown token(s) {unknown}; allowed tokens are {list(AXES)}"
        )
    duplicated = sorted({t for t in tokens if tokens.count(t) > 1})
    if duplicated:
        raise MegatronCoreError(f"order ({order!r}) repeats token(s) {duplicated}")
    if "ep" in tokens and abs(tokens.index("ep") - tokens.index("dp")) != 1:
        raise MegatronCoreError(f"order ({order!r}) must put 'ep' and 'dp' next to each other")
    return tokens


@dataclass(frozen=True)
class RankGrid:
    """The grid of NOTE [ Rank layout ]: a size per axis plus the order string (validated).

    Args:
        tp, pp, dp, cp, ep: tensor, pipeline, data, context and expert parallel sizes. ``dp`` is the
            dense data-parallel size (world = tp * cp * dp * pp); ``ep`` must divide ``dp``.
        order: axis order, fastest-varying first (e.g. "tp-cp-ep-dp-pp" or "tp-pp-dp").
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = "tp-cp-ep-dp-pp"
    tokens: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MegatronCoreError(f"{name} size ({value!r}) must be an integer >= 1")
        tokens = _parse_order(self.order)
        for name in AXES:
            if name not in tokens:
                if getattr(self, name) != 1:
                    raise MegatronCoreError(
                        f"order ({self.order!r}) omits '{name}' but its size is "
                        f"{getattr(self, name)}; only size-1 axes may be omitted"
                    )
                tokens.append(name)
        if self.dp % self.ep:
            raise MegatronCoreError(
                f"expert_model_parallel_size ({self.ep}) must divide the data-parallel size "
                f"({self.dp})"
            )
        object.__setattr__(self, "tokens", tuple(tokens))

    @property
    def world_size(self) -> int:
        """tp * cp * dp * pp: the number of ranks the grid covers."""
        return self.tp * self.cp * self.dp * self.pp

    def _axes(self, with_ep: bool) -> list[tuple[str, int]]:
        axes = []
        for name in self.tokens:
            if name == "ep":
                if with_ep:
                    axes.append(("ep", self.ep))
            elif name == "dp":
                axes.append(("dp", self.dp // self.ep if with_ep else self.dp))
            else:
                axes.append((name, getattr(self, name)))
        return axes

    def ranks(self, kind: str, independent_ep: bool = False) -> list[list[int]]:
        """All groups of one kind, e.g. ``ranks("tp")`` or ``ranks("dp-cp")``.

        Args:
            kind: axes that vary inside a group, joined by '-' (any order).
            independent_ep: read the grid with the expert axis split out of dp (NOTE rule 4);
                then "dp" means data-modulo-expert parallel.
        """
        axes = self._axes(with_ep=independent_ep)
        names = [name for name, _ in axes]
        wanted = kind.split("-")
        missing = [w for w in wanted if w not in names]
        if missing:
            raise MegatronCoreError(
                f"group kind ({kind!r}) names axes {missing} not in the grid {names}"
            )
        mask = [name in wanted for name in names]
        return generate_masked_orthogonal_rank_groups(
            self.world_size, [size for _, size in axes], mask
        )


def embedding_ranks(
    pipeline_ranks: list[int], split_rank: int | None = None
) -> tuple[list[int], list[int]]:
    """Word- and position-embedding ranks of one pipeline group (NOTE [ Rank layout ], rule 5).

    Returns:
        ``(embedding, position_embedding)`` lists of global ranks.
    """
    if len(pipeline_ranks) == 1:
        return list(pipeline_ranks), list(pipeline_ranks)
    first, last = pipeline_ranks[0], pipeline_ranks[-1]
    embedding, position = [first, last], [first]
    if split_rank is not None:
        split = pipeline_ranks[split_rank]
        if split not in embedding:
            embedding = [first, split, last]
        if split not in position:
            position = [first, split]
    return embedding, position
