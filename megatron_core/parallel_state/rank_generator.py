"""The rank grids: which global ranks form each process group (pure logic, no torch.distributed).

The rules are NOTE [ Rank layout ] in the face (megatron_core/parallel_state/__init__.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import check_gtp_size

__all__ = [
    "AXES",
    "RankGenerator",
    "generate_masked_orthogonal_rank_groups",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "hierarchical_rank_groups",
    "hybrid_dp_cp_rank_groups",
]

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

    Raises:
        MegatronCoreError: the sizes do not multiply to ``world_size``, or ``mask`` has
            another length.
    """
    if len(mask) != len(parallel_size):
        raise MegatronCoreError(
            f"mask ({list(mask)}) must have one entry per axis of parallel_size ({parallel_size})"
        )
    if math.prod(parallel_size) != world_size:
        raise MegatronCoreError(
            f"rank grid sizes {list(parallel_size)} multiply to {math.prod(parallel_size)}, "
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


def _parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    if not isinstance(order, str):
        raise MegatronCoreError(f"order ({order!r}) must be a string such as 'tp-cp-ep-dp-pp'")
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise MegatronCoreError(
            f"order ({order!r}) has unknown token(s) {unknown}; allowed tokens are {list(AXES)}"
        )
    duplicated = sorted({t for t in tokens if tokens.count(t) > 1})
    if duplicated:
        raise MegatronCoreError(f"order ({order!r}) repeats token(s) {duplicated}")
    for name in AXES:
        if name not in tokens:
            if sizes[name] != 1:
                raise MegatronCoreError(
                    f"order ({order!r}) omits '{name}' but its size is {sizes[name]}; "
                    f"only size-1 axes may be omitted"
                )
            tokens.append(name)
    return tokens


class RankGenerator:
    """One grid of NOTE [ Rank layout ]: a size per axis plus the order string (megatron-core API).

    Args:
        tp, ep, dp, pp, cp: axis sizes; ``ep`` and ``cp`` may not both exceed 1 (the dense grid
            has cp, the expert grid ep; rule 4).
        order: axis order, fastest-varying first (e.g. "tp-cp-ep-dp-pp" or "tp-pp-dp").
        rank_offset: added to every rank returned by :meth:`get_ranks`.
        gtp_remat: megatron-core 0.19's generalized-TP remat axis; only 1 (none) is supported
            (a larger size raises ConfigError, see model_parallel_config.check_gtp_size).

    Attributes:
        world_size: tp * ep * dp * pp * cp.
        order: the normalized order (lower case, omitted size-1 axes appended).
        ordered_size: the axis sizes in that order.

    Example (rule 2's worked example)::

        RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp").get_ranks("dp")
        # [[0, 2], [1, 3], [4, 6], [5, 7]]
    """

    def __init__(
        self,
        tp: int,
        ep: int,
        dp: int,
        pp: int,
        cp: int,
        order: str,
        rank_offset: int = 0,
        gtp_remat: int = 1,
    ) -> None:
        check_gtp_size("RankGenerator: gtp_remat", gtp_remat)
        self.gtp_remat = gtp_remat
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        for name, value in self.name_to_size.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MegatronCoreError(f"{name} size ({value!r}) must be an integer >= 1")
        if ep > 1 and cp > 1:
            raise MegatronCoreError(
                f"ep ({ep}) and cp ({cp}) may not both exceed 1 in one RankGenerator: cp belongs "
                f"to the dense grid, ep to the expert grid"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        tokens = _parse_order(order, self.name_to_size)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> list[bool]:
        """Mask over the axes of ``order``: True for the axes named in ``token`` ("tp-dp")."""
        axes = order.split("-")
        wanted = token.split("-")
        missing = [t for t in wanted if t not in axes]
        if missing:
            raise MegatronCoreError(f"token ({token!r}) names axes {missing} not in order {axes}")
        return [axis in wanted for axis in axes]

    def get_ranks(self, token: str) -> list[list[int]]:
        """All groups of one kind: the global ranks that vary only along ``token``'s axes.

        Args:
            token: axes joined by '-', in any order, e.g. "tp", "dp-cp" or "tp-pp".
        """
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[r + self.rank_offset for r in group] for group in groups]

    def get_gtp_ranks(self, gtp_remat_size: int) -> list[list[int]]:
        """The generalized-TP weight-remat groups (megatron-core 0.19): one per rank, holding
        just that rank, since the remat axis has size 1 (the only size supported here).

        Raises:
            MegatronCoreError: ``gtp_remat_size`` is not this grid's ``gtp_remat``.
        """
        if gtp_remat_size != self.gtp_remat:
            raise MegatronCoreError(
                f"gtp_remat_size ({gtp_remat_size}) differs from this grid's gtp_remat "
                f"({self.gtp_remat})"
            )
        return [[r + self.rank_offset] for r in range(self.world_size)]


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Word-embedding ranks of one pipeline group: first and last stage (rule 6)."""
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    return [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Position-embedding ranks of one pipeline group: the first stage (rule 6)."""
    return [pp_ranks[0]]


def split_rank_embedding_rules(
    split_rank: int,
) -> tuple[Callable[[list[int]], list[int]], Callable[[list[int]], list[int]]]:
    """Embedding rules with this package's pipeline split stage added to both groups (rule 6)."""

    def embedding(pp_ranks: list[int]) -> list[int]:
        ranks = default_embedding_ranks(pp_ranks)
        split = pp_ranks[split_rank]
        return ranks if split in ranks else [ranks[0], split, *ranks[1:]]

    def position(pp_ranks: list[int]) -> list[int]:
        ranks = default_position_embedding_ranks(pp_ranks)
        split = pp_ranks[split_rank]
        return ranks if split in ranks else [*ranks, split]

    return embedding, position


def hierarchical_rank_groups(ranks: list[int], sizes: list[int]) -> list[list[list[int]]]:
    """Sub-groups of ``ranks`` per level of hierarchical context parallelism (rule 8).

    Example: 8 ranks with sizes [2, 4] give level 0 [[r0, r1], [r2, r3], [r4, r5], [r6, r7]] and
    level 1 [[r0, r2, r4, r6], [r1, r3, r5, r7]].

    Returns:
        One list of groups per level.
    """
    if math.prod(sizes) != len(ranks):
        raise MegatronCoreError(
            f"hierarchical sizes {list(sizes)} multiply to {math.prod(sizes)}, not to the group "
            f"size ({len(ranks)})"
        )
    levels = []
    for level in range(len(sizes)):
        shape = [math.prod(sizes[:level]), sizes[level], math.prod(sizes[level + 1 :])]
        index_groups = generate_masked_orthogonal_rank_groups(
            len(ranks), shape, [False, True, False]
        )
        levels.append([[ranks[i] for i in group] for group in index_groups])
    return levels


def hybrid_dp_cp_rank_groups(ranks: list[int]) -> dict[int, list[list[int]]]:
    """Hybrid data x context groups: for sizes 2, 4, ... below len(ranks), consecutive chunks."""
    sizes = [2**i for i in range(1, int(math.log2(len(ranks))))]
    return {size: [ranks[i : i + size] for i in range(0, len(ranks), size)] for size in sizes}
