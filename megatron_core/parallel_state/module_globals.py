"""megatron-core's module-level globals of ``parallel_state`` as views of the one ParallelState.

megatron-core keeps its groups, ranks and sizes in module globals (``_TENSOR_MODEL_PARALLEL_GROUP``,
``_PIPELINE_GLOBAL_RANKS``, ``_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE``, ...), and code and tests
written for it read (and sometimes assign) them. Here they are not stored anywhere:

# NOTE [ Module globals ]
1. Reading ``parallel_state._X`` computes the value from the current ParallelState (state.py):
   the group, rank list, ``set_*`` override, virtual-pipeline value or buffer that megatron-core
   keeps in ``_X``. Absent -> None (before ``initialize_model_parallel``, after
   ``destroy_model_parallel``, or a group this rank is not in, e.g. an embedding group on a
   middle stage), as in megatron-core. ``_HYBRID_DP_CP_GROUPS`` is a dict ({} when empty).
2. Assigning ``parallel_state._X = v`` (a test's monkeypatch) writes ``v`` into the state, so the
   getters see it at once; assigning None removes it. ``del parallel_state._X`` puts back the
   value ``_X`` had before its first assignment (what ``unittest.mock.patch`` does on exit for a
   name that is not in the module's ``__dict__``). A later ``initialize_model_parallel`` or
   ``destroy_model_parallel`` replaces the state and with it every such assignment (megatron-core
   overwrites its globals there too).
3. Nothing else about the face changes: other attributes are ordinary module attributes.
"""

from __future__ import annotations

import types
from typing import Any

from megatron_core.parallel_state.state import ParallelState, _state

__all__ = ["MODULE_GLOBALS", "MODULE_GLOBALS_0_19", "ParallelStateModule"]

# megatron-core 0.16.1 name -> (where in ParallelState, key). Where: "group" (groups), "gloo"
# (gloo_groups), "ranks" (ranks), "override" (overrides), "attr" (an attribute).
_GROUPS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embedding",
    "_POSITION_EMBEDDING_GROUP": "position_embedding",
    "_DATA_PARALLEL_GROUP": "dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp-dp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt-tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp-ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp-ep-pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt-dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "intra-expt-dp",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter-dist-opt",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp-cp",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": "dp-cp-ag",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra-dp-cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp-cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp-dp-cp",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra-dist-opt",
}
_GLOO_GROUPS = {
    "_DATA_PARALLEL_GROUP_GLOO": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp-cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "intra-dp-cp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expt-dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "intra-expt-dp",
}
_RANKS = {
    "_EMBEDDING_GLOBAL_RANKS": "embedding",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "position_embedding",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp-cp",
}
_OVERRIDES = {
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": "tp_size",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": "tp_rank",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "pp_size",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK": "pp_rank",
    "_MPU_DATA_PARALLEL_WORLD_SIZE": "dp_size",
    "_MPU_DATA_PARALLEL_RANK": "dp_rank",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": "ep_size",
    "_MPU_EXPERT_MODEL_PARALLEL_RANK": "ep_rank",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": "etp_size",
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK": "etp_rank",
}
_ATTRS = {
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": "virtual_pipeline_model_parallel_rank",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "virtual_pipeline_model_parallel_size",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": "hierarchical_cp_groups",
    "_HYBRID_DP_CP_GROUPS": "hybrid_dp_cp_groups",
    "_GLOBAL_MEMORY_BUFFER": "memory_buffer",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": "symmetric_memory_buffer",
}

# megatron-core 0.19's new globals (generalized TP). At remat size 1, the only size here, 0.19 sets
# the *_WITH_GTP_REMAT groups to the plain ones and the remat groups to one rank each; so do these
# (assigning one of the aliases assigns the plain group too).
_GROUPS_0_19 = {
    "_GTP_WEIGHT_REMAT_GROUP": "gtp-remat",
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP": "expt-gtp-remat",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "tp-ep-pp",
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "dp-cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "intra-dp-cp",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expt-dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "intra-expt-dp",
}
_RANKS_0_19 = {
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "gtp-remat",
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": "expt-gtp-remat",
}
MODULE_GLOBALS_0_19 = frozenset(_GROUPS_0_19) | frozenset(_RANKS_0_19)

MODULE_GLOBALS: dict[str, tuple[str, str]] = {
    **{name: ("groups", key) for name, key in _GROUPS.items()},
    **{name: ("gloo_groups", key) for name, key in _GLOO_GROUPS.items()},
    **{name: ("ranks", key) for name, key in _RANKS.items()},
    **{name: ("overrides", key) for name, key in _OVERRIDES.items()},
    **{name: ("attr", key) for name, key in _ATTRS.items()},
    **{name: ("groups", key) for name, key in _GROUPS_0_19.items()},
    **{name: ("ranks", key) for name, key in _RANKS_0_19.items()},
}


def read_global(state: ParallelState, name: str) -> Any:
    """The value megatron-core would hold in global ``name`` (NOTE [ Module globals ], rule 1)."""
    where, key = MODULE_GLOBALS[name]
    if where == "attr":
        return getattr(state, key)
    return getattr(state, where).get(key)


def write_global(state: ParallelState, name: str, value: Any) -> None:
    """Store ``value`` where global ``name`` is read from (rule 2); None removes a mapping entry."""
    where, key = MODULE_GLOBALS[name]
    if where == "attr":
        if key == "hybrid_dp_cp_groups" and value is None:
            value = {}
        setattr(state, key, value)
    elif value is None:
        getattr(state, where).pop(key, None)
    else:
        getattr(state, where)[key] = value


class ParallelStateModule(types.ModuleType):
    """The parallel_state face's module type: megatron-core's globals read and write the state."""

    def __getattr__(self, name: str) -> Any:
        """Called for names not found the usual way: a megatron-core global, else AttributeError."""
        if name in MODULE_GLOBALS:
            return read_global(_state(), name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """A megatron-core global goes into the state; anything else is a module attribute."""
        if name in MODULE_GLOBALS:
            state = _state()
            state.assigned_globals.setdefault(name, read_global(state, name))
            write_global(state, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        """Deleting a megatron-core global restores its value from before the first assignment
        (None if it was never assigned). See NOTE [ Module globals ], rule 2."""
        if name in MODULE_GLOBALS:
            state = _state()
            write_global(state, name, state.assigned_globals.pop(name, None))
        else:
            super().__delattr__(name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(MODULE_GLOBALS))
