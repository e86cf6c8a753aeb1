"""Process groups for tensor / pipeline / data / context / expert parallelism.

Drop-in for megatron-core 0.16's ``parallel_state``: every public function, same parameters and
defaults, same rank layout (NOTE [ Rank layout ] in rank_generator.py). This file is the face;
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
"""

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
