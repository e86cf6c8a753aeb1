"""Shared helpers with megatron-core's names and semantics (``megatron.core.utils``): the face.

megatron-core's tensor_parallel and pipeline_parallel import these from ``megatron.core.utils``;
its tests patch them there. basics.py: divide, version checks, rank-0 logging; groups.py:
process-group and wrapped-model helpers; tensors.py: viewless tensors, the embedding-wgrad
drain, sharded tensors for dist_checkpointing; nvtx.py: NVTX ranges. ``GlobalMemoryBuffer``
lives in parallel_state (which uses it) and is re-exported here, megatron-core's path.

Deliberate differences from megatron-core 0.16.1: ``divide`` / ``ensure_divisibility`` raise
MegatronCoreError (an AssertionError, what megatron-core's ``assert`` raises) naming both values;
``is_te_min_version`` answers False when Transformer Engine is not installed (megatron-core
raises TypeError comparing None with a version); the NVTX helpers open ranges through
``megatron_core.device`` and do nothing on cpu.
"""

from megatron_core.parallel_state.memory_buffer import GlobalMemoryBuffer
from megatron_core.utils.basics import (
    divide,
    ensure_divisibility,
    get_te_version,
    get_torch_version,
    is_te_min_version,
    is_torch_min_version,
    log_single_rank,
)
from megatron_core.utils.groups import (
    get_attr_wrapped_model,
    get_model_config,
    get_model_type,
    get_model_xattn,
    get_pg_rank,
    get_pg_size,
    get_pg_src_rank,
    get_tensor_model_parallel_group_if_none,
)
from megatron_core.utils.nvtx import (
    configure_nvtx_profiling,
    nvtx_decorator,
    nvtx_range_pop,
    nvtx_range_push,
)
from megatron_core.utils.tensors import (
    assert_viewless_tensor,
    drain_embedding_wgrad_compute,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
    make_viewless_tensor,
    prepare_input_tensors_for_wgrad_compute,
    safely_set_viewless_tensor_data,
)

__all__ = [
    # parallel_state/memory_buffer.py
    "GlobalMemoryBuffer",
    # basics.py
    "ensure_divisibility",
    "divide",
    "get_torch_version",
    "is_torch_min_version",
    "get_te_version",
    "is_te_min_version",
    "log_single_rank",
    # groups.py
    "get_tensor_model_parallel_group_if_none",
    "get_pg_size",
    "get_pg_rank",
    "get_pg_src_rank",
    "get_attr_wrapped_model",
    "get_model_type",
    "get_model_xattn",
    "get_model_config",
    # nvtx.py
    "configure_nvtx_profiling",
    "nvtx_range_push",
    "nvtx_range_pop",
    "nvtx_decorator",
    # tensors.py
    "make_viewless_tensor",
    "assert_viewless_tensor",
    "safely_set_viewless_tensor_data",
    "prepare_input_tensors_for_wgrad_compute",
    "drain_embedding_wgrad_compute",
    "make_tp_sharded_tensor_for_checkpoint",
    "make_sharded_tensor_for_checkpoint",
]
