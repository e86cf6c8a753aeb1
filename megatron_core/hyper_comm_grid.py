"""HyperCommGrid: named parallel dimensions over a block of ranks, groups on demand (0.16.1).

megatron-core's ``megatron.core.hyper_comm_grid``: a model that builds its own process groups
(``ProcessGroupCollection(tp=grid.get_pg("tp"), ...)``) instead of parallel_state's.

# NOTE [ Hyper grid ranks ]
1. ``shape[i]`` ranks along ``dim_names[i]``; the FIRST name varies fastest, as in
   ``initialize_model_parallel``'s ``order`` ("tp-cp-pp-dp": tp neighbours are adjacent ranks).
   The grid covers ranks ``rank_offset .. rank_offset + prod(shape) - 1``:
   ``rank = rank_offset + sum_i index_i * prod(shape[:i])``.
2. A group over some dims holds the ranks that differ only along those dims; the grid has
   ``prod(other dims)`` such groups. Its key lists the dims in reversed ``dim_names`` order
   (slowest first), whatever order they were asked in: ``["tp", "dp"]`` and ``["dp", "tp"]`` over
   dim_names ("tp", "cp", "dp") are both "dp-tp".
3. ``get_rank_enum`` lists the groups with the remaining dims (slowest first) as the outer index
   and, inside a group, the ranks with the keyed dims row-major (the last key dim fastest).
   Worked example, shape [2, 2, 2] over ("tp", "pp", "dp") on 8 ranks:
     get_rank_enum("tp")          -> [[0, 1], [2, 3], [4, 5], [6, 7]]
     get_rank_enum("pp")          -> [[0, 2], [1, 3], [4, 6], [5, 7]]
     get_rank_enum(["tp", "dp"])  -> [[0, 1, 4, 5], [2, 3, 6, 7]]      (key "dp-tp")
4. ``create_pg`` creates every group of the enumeration (``new_subgroups_by_enumeration``: all
   ranks of the world must call it, in the same order) and returns this rank's (None outside the
   grid). A key is created once; creating it again raises, because the options of the first
   creation cannot be compared with the new ones.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from typing import Any

import torch.distributed as dist

from megatron_core.errors import ConfigError, MegatronCoreError

__all__ = ["HyperCommGrid", "GridKeyError"]

logger = logging.getLogger(__name__)


class GridKeyError(MegatronCoreError, KeyError):
    """A group key created twice, or read before it was created (a KeyError, as megatron-core)."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class HyperCommGrid:
    """An N-dimensional grid of ranks with a name per dimension; see NOTE [ Hyper grid ranks ].

    Args:
        shape: ranks along each dimension.
        dim_names: one name per dimension, fastest-varying first.
        rank_offset: the grid's first global rank (a grid may cover part of the world).
        backend: torch.distributed backend for the groups; None is the default backend.

    Raises:
        ConfigError: ``shape`` and ``dim_names`` differ in length, or ``rank_offset`` < 0.
        MegatronCoreError: the world size is unknown (no ``WORLD_SIZE`` variable and
            torch.distributed not initialized), or the grid does not fit in it.

    Example::

        grid = HyperCommGrid([2, 2], ["tp", "dp"])       # 4 ranks
        tp_group = grid.create_pg("tp")                  # ranks {0, 1} and {2, 3}
        dp_group = grid.create_pg(["dp"])                # ranks {0, 2} and {1, 3}
        assert grid.get_pg("tp") is tp_group
    """

    def __init__(
        self,
        shape: list[int],
        dim_names: list[str],
        rank_offset: int = 0,
        backend: str | None = None,
    ) -> None:
        if len(shape) != len(dim_names):
            raise ConfigError(
                f"HyperCommGrid: shape {shape} has {len(shape)} dims but dim_names {dim_names} "
                f"has {len(dim_names)}"
            )
        # WORLD_SIZE first, as megatron-core: a grid can be planned without torch.distributed.
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise MegatronCoreError(
                "HyperCommGrid: cannot determine the world size: set WORLD_SIZE or initialize "
                "torch.distributed first"
            )
        if rank_offset < 0:
            raise ConfigError(f"HyperCommGrid: rank_offset ({rank_offset}) must be >= 0")
        self.rank_offset = rank_offset
        self.size = math.prod(shape)
        if self.size > world_size - rank_offset:
            raise MegatronCoreError(
                f"HyperCommGrid: shape {shape} ({self.size} ranks) does not fit in world size "
                f"{world_size} from rank offset {rank_offset}"
            )
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.backend = backend
        self._pgs: dict[str, dist.ProcessGroup | None] = {}

    def create_pg(self, dims: str | list[str], **kwargs: Any) -> dist.ProcessGroup | None:
        """Create the groups over ``dims`` (NOTE [ Hyper grid ranks ], rule 4); this rank's.

        Args:
            dims: a dimension name or a list of them (any order; see rule 2 for the key).
            **kwargs: passed to ``torch.distributed.new_subgroups_by_enumeration`` (timeout,
                pg_options, group_desc).

        Returns:
            This rank's group, or None when this rank is outside the grid.

        Raises:
            GridKeyError: the groups over these dims were created before (a KeyError).
            ConfigError: a name is not one of ``dim_names``.
        """
        ordered, key = self._order_dims(dims)
        if key in self._pgs:
            raise GridKeyError(
                f"HyperCommGrid.create_pg({dims!r}): group {key!r} already exists; it is created "
                f"once (its options cannot be compared with a second request's)"
            )
        rank_enum = self._gen_rank_enum(ordered)
        pg, _ = dist.new_subgroups_by_enumeration(rank_enum, backend=self.backend, **kwargs)
        if dist.get_rank() == 0:
            logger.info("HyperCommGrid: created group %s with ranks %s", key, rank_enum)
        self._pgs[key] = pg
        return pg

    def get_pg(self, dims: str | list[str]) -> dist.ProcessGroup | None:
        """This rank's group over ``dims``, created before by :meth:`create_pg`.

        Raises:
            GridKeyError: not created yet (a KeyError).
        """
        _, key = self._order_dims(dims)
        if key not in self._pgs:
            raise GridKeyError(
                f"HyperCommGrid.get_pg({dims!r}): group {key!r} has not been created; call "
                f"create_pg first (created: {sorted(self._pgs)})"
            )
        return self._pgs[key]

    def get_rank_enum(self, dims: str | list[str]) -> list[list[int]]:
        """Every group's global ranks over ``dims``, as :meth:`create_pg` would create them.

        See NOTE [ Hyper grid ranks ], rule 3 (a worked example). No collective runs.
        """
        ordered, _ = self._order_dims(dims)
        return self._gen_rank_enum(ordered)

    def _gen_rank_enum(self, dims: list[str]) -> list[list[int]]:
        """Groups over ``dims`` taken in the given order (rule 3); no reordering, no key."""
        unknown = [d for d in dims if d not in self.dim_names]
        if unknown:
            raise ConfigError(f"HyperCommGrid: unknown dims {unknown} (dim_names {self.dim_names})")
        sizes = dict(zip(self.dim_names, self.shape))
        strides = {d: math.prod(self.shape[:i]) for i, d in enumerate(self.dim_names)}
        rest = [d for d in reversed(self.dim_names) if d not in dims]

        def ranks(names, base):
            return [
                base + sum(i * strides[d] for d, i in zip(names, index))
                for index in itertools.product(*(range(sizes[d]) for d in names))
            ]

        return [ranks(dims, outer) for outer in ranks(rest, self.rank_offset)]

    def _order_dims(self, dims: str | list[str]) -> tuple[list[str], str]:
        """``dims`` in reversed ``dim_names`` order, and the key "a-b" they form (rule 2)."""
        if not isinstance(dims, list):
            ordered = [dims]
        else:
            reverse = self.dim_names[::-1]
            unknown = [d for d in dims if d not in reverse]
            if unknown:
                raise ConfigError(
                    f"HyperCommGrid: unknown dims {unknown} (dim_names {self.dim_names})"
                )
            ordered = sorted(dims, key=reverse.index)
        return ordered, "-".join(ordered)
