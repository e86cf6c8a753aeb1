"""Process groups for tensor / pipeline / data / context / expert parallelism.

Drop-in for megatron-core 0.16's ``parallel_state``: every public function, same parameters and
defaults, same rank layout (NOTE [ Rank layout ] below). This file is the face;
the package is built in layers, each file one idea:

* state.py: :class:`ParallelState`, the one state object (always exists; getters read it).
* rank_generator.py: ``RankGenerator`` and the rank grids (pure logic).
* layout.py: validate the sizes -> both grids' rank lists, no collective.
* groups.py: create / reuse process groups (NCCL options, hierarchical cp, hybrid dp-cp).
* create.py: build every group of a layout into a new state.
* initialize.py: ``initialize_model_parallel`` / ``destroy_model_parallel``.
* all_gather_groups.py: ``create_all_gather_groups`` (megatron-core 0.18).
* getters_dense.py, getters_expert.py, getters_pipeline.py: megatron-core's getters and setters,
  which raise :class:`~megatron_core.errors.MegatronCoreError` (an ``AssertionError`` too) where
  megatron-core asserts.
* module_globals.py: megatron-core's module globals (``_TENSOR_MODEL_PARALLEL_GROUP``, ...), read
  and written through this face's module type (NOTE [ Module globals ]).
* memory_buffer.py: ``GlobalMemoryBuffer`` (megatron's path ``utils.GlobalMemoryBuffer`` too).

# NOTE [ Rank layout ]
#
# Every process group megatron_core creates comes from two grids of ranks laid out exactly as
# megatron-core 0.16 lays them, so a job ported from megatron-core puts the same ranks together.
#
# 1. The order string names a grid's axes from fastest- to slowest-varying: the default
#    "tp-cp-ep-dp-pp" means consecutive global ranks differ first in their tensor-parallel
#    coordinate, then context, expert, data and last pipeline. An axis missing from the string
#    must have size 1; it is appended at the end.
# 2. A global rank r has the coordinate  (r // stride_k) % size_k  on axis k, where stride_k is
#    the product of the sizes of the axes before k (a mixed-radix number, the first axis lowest).
# 3. A group of kind "a-b" (e.g. "tp", "dp-cp", "tp-pp") holds the ranks that share every
#    coordinate EXCEPT those on axes a and b. Inside a group, ranks are ordered by their a/b
#    coordinates read as a mixed-radix number in grid order (so ascending); groups are ordered the
#    same way by the other coordinates. This is generate_masked_orthogonal_rank_groups.
# 4. Two grids share the order string. The DENSE grid has axes tp, cp, dp, pp (ep = 1) with
#    dp = world / (tp * cp * pp). The EXPERT grid has etp (expert tensor parallel, default tp) on
#    the "tp" slot, ep, expert-dp on the "dp" slot and pp, with cp = 1: context parallelism is
#    folded into expert-dp = world / (etp * ep * pp). So etp * ep * pp must divide the world; ep
#    need not divide dp. Expert kinds ("ep", "expt-tp", "tp-ep", "tp-ep-pp", "expt-dp") are read
#    from the expert grid, every other kind from the dense grid.
# 5. Both grids must give the same pipeline groups (checked). With pp > 1 and an order that does
#    not end in "pp", that needs expert-dp == dp.
# 6. Embedding groups come from each pipeline group P: by default the word-embedding group is
#    [P[0], P[-1]] (first and last stage share the tied embedding; [P[0]] for one stage) and the
#    position-embedding group [P[0]]. initialize_model_parallel accepts functions that replace
#    either rule; this package's pipeline split rank s (an extension) adds P[s] to both.
# 7. With n distributed-optimizer instances, each dp-cp group is cut into n consecutive chunks
#    ("intra-dp-cp"), each expert-dp group likewise ("intra-expt-dp"), and rank i of every chunk
#    forms the "inter-dist-opt" group. "intra-dist-opt" joins every expert-dp-size / n
#    consecutive tp-ep-pp groups (one optimizer instance).
# 8. Hierarchical context parallelism with sizes [s0, s1, ...] (product cp) splits each cp group
#    C: level k groups the entries of C whose index differs only in digit k of the mixed-radix
#    number with digits of sizes s0, s1, ... (s0 lowest).
#
# Worked example, 8 ranks, tp=2, pp=2 (so dp=2), order "tp-cp-ep-dp-pp":
#     dense axes (tp, cp, ep, dp, pp) with sizes (2, 1, 1, 2, 2) and strides (1, 2, 2, 2, 4)
#     tensor groups   [0, 1] [2, 3] [4, 5] [6, 7]       (vary tp)
#     data groups     [0, 2] [1, 3] [4, 6] [5, 7]       (vary dp)
#     pipeline groups [0, 4] [1, 5] [2, 6] [3, 7]       (vary pp)
#     model groups    [0, 1, 4, 5] [2, 3, 6, 7]        (vary tp and pp)
#     embedding groups = the pipeline groups (first and last stage of a 2-stage pipeline)
# Expert example, 8 ranks, cp=2, ep=2 (tp = etp = pp = 1): dense cp groups [0, 1] [2, 3] [4, 5]
# [6, 7] and dp groups [0, 2, 4, 6] [1, 3, 5, 7]; expert grid (1, 1, 2, 4, 1) gives ep groups
# [0, 1] [2, 3] [4, 5] [6, 7] and expert-dp groups [0, 2, 4, 6] [1, 3, 5, 7].
# tests/parallel_state/test_rank_grid.py checks both examples and hand-written tables for worlds
# 1, 2, 4, 8.
"""

import sys as _sys

from megatron_core.parallel_state.all_gather_groups import create_all_gather_groups
from megatron_core.parallel_state.getters_dense import *  # noqa: F403
from megatron_core.parallel_state.getters_dense import __all__ as _dense_names
from megatron_core.parallel_state.getters_expert import *  # noqa: F403
from megatron_core.parallel_state.getters_expert import __all__ as _expert_names
from megatron_core.parallel_state.getters_pipeline import *  # noqa: F403
from megatron_core.parallel_state.getters_pipeline import __all__ as _pipeline_names
from megatron_core.parallel_state.groups import (
    create_group,
    create_hierarchical_groups,
    create_hybrid_dp_cp_groups,
    get_nccl_options,
    overwrite_nccl_comm_cfgs,
    update_pg_timeout,
)
from megatron_core.parallel_state.initialize import (
    destroy_model_parallel,
    initialize_model_parallel,
)
from megatron_core.parallel_state.layout import compute_rank_layout
from megatron_core.parallel_state.module_globals import ParallelStateModule as _Module
from megatron_core.parallel_state.rank_generator import (
    RankGenerator,
    default_embedding_ranks,
    default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups,
)
from megatron_core.parallel_state.state import (
    ParallelState,
    destroy_global_memory_buffer,
    destroy_global_symmetric_memory_buffer,
    get_global_memory_buffer,
    get_global_symmetric_memory_buffer,
    get_parallel_state,
    is_initialized,
    is_unitialized,
    model_parallel_is_initialized,
)

__all__ = [
    # state.py
    "ParallelState",
    "get_parallel_state",
    "is_initialized",
    "is_unitialized",
    "model_parallel_is_initialized",
    "get_global_memory_buffer",
    "get_global_symmetric_memory_buffer",
    "destroy_global_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
    # layout.py, rank_generator.py
    "compute_rank_layout",
    "RankGenerator",
    "generate_masked_orthogonal_rank_groups",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    # groups.py
    "get_nccl_options",
    "overwrite_nccl_comm_cfgs",
    "update_pg_timeout",
    "create_group",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
    # all_gather_groups.py (megatron-core 0.18)
    "create_all_gather_groups",
    # initialize.py
    "initialize_model_parallel",
    "destroy_model_parallel",
]
# getters_dense.py, getters_pipeline.py, getters_expert.py
__all__ += _dense_names + _pipeline_names + _expert_names

# megatron-core's module globals (_TENSOR_MODEL_PARALLEL_GROUP, ...) read and write the state.
# See NOTE [ Module globals ] in module_globals.py.
_sys.modules[__name__].__class__ = _Module
