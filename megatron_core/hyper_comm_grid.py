"""HyperCommGrid: named parallel dimensions over a block of ranks, groups on demand (0.16.1;
megatron-core 0.19's views, ``destroy`` and ``is_current_rank_in_grid``).

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
   Worked example, shape [2, 2, 2] over ("tp", "pp", "dp") on 8 ranks::

     get_rank_enum("tp")          -> [[0, 1], [2, 3], [4, 5], [6, 7]]
     get_rank_enum("pp")          -> [[0, 2], [1, 3], [4, 6], [5, 7]]
     get_rank_enum(["tp", "dp"])  -> [[0, 1, 4, 5], [2, 3, 6, 7]]      (key "dp-tp")

4. ``create_pg`` creates every group of the enumeration (``new_subgroups_by_enumeration``: all
   ranks of the world must call it, in the same order) and returns this rank's (None outside the
   grid). A key is created once; creating it again raises, because the options of the first
   creation cannot be compared with the new ones.
5. Views (megatron-core 0.19): ``register_view(name, shape, dim_names, shared_dims)`` adds another
   factorization of the same ranks (same size, rules 1-3 with its own shape and names). Every
   method takes ``view=`` (default the base grid). A shared dim must group the ranks exactly as
   the base grid's dim of that name does (checked at registration, also all shared dims
   together); groups over shared dims only ARE the base grid's groups (one key, one creation).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_core.errors import ConfigError, MegatronCoreError

__all__ = ["HyperCommGrid", "GridKeyError"]

logger = logging.getLogger(__name__)


_BASE = "base"


@dataclass
class _View:
    """One factorization of the grid's ranks (rule 5): sizes and names, fastest first."""

    shape: list[int]
    dim_names: list[str]
    shared: list[str]


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
                f"HyperCommGrid: len(shape) ({len(shape)}) != len(dim_names) ({len(dim_names)}): "
                f"shape {shape}, dim_names {dim_names}"
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
                f"HyperCommGrid: Grid shape {shape} ({self.size} ranks) is over sized: it does not "
                f"fit in world size {world_size} from rank offset {rank_offset}"
            )
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.backend = backend
        self._pgs: dict[str | tuple, dist.ProcessGroup | None] = {}
        self._views: dict[str, _View] = {_BASE: _View(self.shape, self.dim_names, [])}

    def register_view(
        self,
        name: str,
        shape: list[int],
        dim_names: list[str],
        shared_dims: list[str] | None = None,
    ) -> None:
        """Register another factorization of the grid's ranks (megatron-core 0.19; rule 5).

        Args:
            name: the view's name, passed as ``view=`` to the other methods.
            shape, dim_names: its dimensions, fastest-varying first; the product must equal the
                grid's size.
            shared_dims: names in both views whose groups must coincide with the base grid's.

        Raises:
            ConfigError: (a ValueError, as megatron-core raises) a taken name, mismatched
                lengths, duplicate or unknown names, a size that differs from the grid's, or a
                shared dim whose groups differ between the views (the message shows both
                enumerations).
        """
        what = f"HyperCommGrid.register_view({name!r})"
        if name in self._views:
            raise ConfigError(f"{what}: a view of that name is already registered")
        shared = list(shared_dims or [])
        if len(shape) != len(dim_names) or len(set(dim_names)) != len(dim_names):
            raise ConfigError(f"{what}: shape {shape} / dim_names {dim_names} must pair up, "
                              "with distinct names")  # fmt: skip
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
            raise ConfigError(f"{what}: shape {shape} must hold positive ints")
        if math.prod(shape) != self.size:
            raise ConfigError(
                f"{what}: shape {shape} has {math.prod(shape)} ranks, the grid {self.size}"
            )
        if len(set(shared)) != len(shared) or any(
            d not in self.dim_names or d not in dim_names for d in shared
        ):
            raise ConfigError(
                f"{what}: shared_dims {shared} must be distinct names of both the base grid "
                f"{self.dim_names} and the view {dim_names}"
            )
        view = _View(list(shape), list(dim_names), shared)
        base = self._views[_BASE]
        for dims in [[d] for d in shared] + ([shared] if len(shared) > 1 else []):
            ours, theirs = self._enum(base, dims), self._enum(view, dims)
            if ours != theirs:
                raise ConfigError(
                    f"{what}: shared dims {dims} group the ranks differently: base {ours}, "
                    f"view {theirs}"
                )
        self._views[name] = view

    def create_pg(
        self, dims: str | list[str], *, view: str | None = None, **kwargs: Any
    ) -> dist.ProcessGroup | None:
        """Create the groups over ``dims`` (NOTE [ Hyper grid ranks ], rule 4); this rank's.

        Args:
            dims: a dimension name or a list of them (any order; see rule 2 for the key).
            view: a registered view's name (rule 5); default the base grid.
            **kwargs: passed to ``torch.distributed.new_subgroups_by_enumeration`` (timeout,
                pg_options, group_desc).

        Returns:
            This rank's group, or None when this rank is outside the grid.

        Raises:
            GridKeyError: the groups over these dims were created before (a KeyError).
            ConfigError: a name is not one of the view's ``dim_names``.
            GridKeyError: an unknown view.
        """
        key, grid, ordered = self._key(dims, view)
        if key in self._pgs:
            raise GridKeyError(
                f"HyperCommGrid.create_pg({dims!r}): Process group {key!r} has already been "
                f"created; each is created once (its options cannot be compared with a second "
                f"request's)"
            )
        rank_enum = self._enum(grid, ordered)
        pg, _ = dist.new_subgroups_by_enumeration(rank_enum, backend=self.backend, **kwargs)
        if dist.get_rank() == 0:
            logger.info("HyperCommGrid: created group %s with ranks %s", key, rank_enum)
        self._pgs[key] = pg
        return pg

    def get_pg(self, dims: str | list[str], *, view: str | None = None) -> dist.ProcessGroup | None:
        """This rank's group over ``dims`` (of ``view``), created before by :meth:`create_pg`.

        Raises:
            GridKeyError: not created yet, or an unknown view (a KeyError).
        """
        key, _, _ = self._key(dims, view)
        if key not in self._pgs:
            raise GridKeyError(
                f"HyperCommGrid.get_pg({dims!r}): Process group for {key!r} hasn't been created; "
                f"call create_pg first (created: {sorted(self._pgs)})"
            )
        return self._pgs[key]

    def get_rank_enum(self, dims: str | list[str], *, view: str | None = None) -> list[list[int]]:
        """Every group's global ranks over ``dims`` (of ``view``), as :meth:`create_pg` would
        create them. See NOTE [ Hyper grid ranks ], rule 3 (a worked example). No collective."""
        grid = self._view(view)
        ordered, _ = self._order_dims(dims, grid.dim_names)
        return self._enum(grid, ordered)

    def destroy(self) -> None:
        """Destroy every group this grid created that this rank belongs to, each once
        (megatron-core 0.19); the grid then holds no groups."""
        done = set()
        for pg in self._pgs.values():
            if (
                pg is not None
                and pg is not dist.GroupMember.NON_GROUP_MEMBER
                and id(pg) not in done
            ):
                dist.destroy_process_group(pg)
                done.add(id(pg))
        self._pgs.clear()

    def is_current_rank_in_grid(self) -> bool:
        """True if this rank is one of the grid's (megatron-core 0.19)."""
        return self.rank_offset <= dist.get_rank() < self.rank_offset + self.size

    def _gen_rank_enum(self, dims: list[str]) -> list[list[int]]:
        """Groups over ``dims`` of the base grid, in the given order (rule 3)."""
        return self._enum(self._views[_BASE], dims)

    def _view(self, view: str | None) -> _View:
        name = _BASE if view is None else view
        if name not in self._views:
            raise GridKeyError(
                f"HyperCommGrid: view {name!r} is not registered (views: {sorted(self._views)})"
            )
        return self._views[name]

    def _key(self, dims, view: str | None):
        """(storage key, grid to enumerate, ordered dims): base keys are "a-b"; a view's are
        (view, dims) unless all dims are shared, when they are the base grid's (rule 5)."""
        grid = self._view(view)
        ordered, key = self._order_dims(dims, grid.dim_names)
        if view is None or view == _BASE:
            return key, grid, ordered
        if all(d in grid.shared for d in ordered):
            base = self._views[_BASE]
            ordered, key = self._order_dims(ordered, base.dim_names)
            return key, base, ordered
        return (view, tuple(ordered)), grid, ordered

    def _enum(self, grid: _View, dims: list[str]) -> list[list[int]]:
        """Groups over ``dims`` of ``grid``, taken in the given order (rule 3)."""
        unknown = [d for d in dims if d not in grid.dim_names]
        if unknown:
            raise ConfigError(f"HyperCommGrid: unknown dims {unknown} (dim_names {grid.dim_names})")
        sizes = dict(zip(grid.dim_names, grid.shape))
        strides = {d: math.prod(grid.shape[:i]) for i, d in enumerate(grid.dim_names)}
        rest = [d for d in reversed(grid.dim_names) if d not in dims]

        def ranks(names, base):
            return [
                base + sum(i * strides[d] for d, i in zip(names, index))
                for index in itertools.product(*(range(sizes[d]) for d in names))
            ]

        return [ranks(dims, outer) for outer in ranks(rest, self.rank_offset)]

    def _order_dims(self, dims: str | list[str], dim_names=None) -> tuple[list[str], str]:
        """``dims`` in reversed ``dim_names`` order, and the key "a-b" they form (rule 2)."""
        dim_names = self.dim_names if dim_names is None else dim_names
        if not isinstance(dims, list):
            if dims not in dim_names:
                raise ConfigError(f"HyperCommGrid: unknown dims [{dims!r}] (dim_names {dim_names})")
            ordered = [dims]
        else:
            reverse = dim_names[::-1]
            unknown = [d for d in dims if d not in reverse]
            if unknown:
                raise ConfigError(f"HyperCommGrid: unknown dims {unknown} (dim_names {dim_names})")
            ordered = sorted(dims, key=reverse.index)
        return ordered, "-".join(ordered)
