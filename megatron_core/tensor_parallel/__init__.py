"""Tensor parallelism: layers, communication regions, cross entropy, data, RNG, checkpointing.

Mirrors ``megatron.core.tensor_parallel``; each block below re-exports one source file.
"""

# Each section below imports its file's public names and extends __all__ with them, e.g.
# __all__ += ["divide", "split_tensor_along_last_dim"]
__all__: list[str] = []

# --- section: utils.py divide/split/VocabUtility (owner: mappings) ---
from megatron_core.tensor_parallel.utils import (  # noqa: E402
    VocabUtility,
    divide,
    ensure_divisibility,
    split_tensor_along_last_dim,
)

__all__ += ["divide", "ensure_divisibility", "split_tensor_along_last_dim", "VocabUtility"]
# --- end section: utils.py divide/split/VocabUtility ---

# --- section: utils.py 1-D chunks (owner: checkpoint) ---
from megatron_core.tensor_parallel.utils import (  # noqa: E402
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)

__all__ += ["split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor"]
# --- end section: utils.py 1-D chunks ---

# --- section: mappings.py (owner: mappings) ---
from megatron_core.tensor_parallel.mappings import (  # noqa: E402
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

__all__ += [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "all_to_all",
    "all_to_all_sp2hp",
    "all_to_all_hp2sp",
]
# --- end section: mappings.py ---

# --- section: layers.py (owner: layers) ---
from megatron_core.tensor_parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)

__all__ += [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "linear_with_grad_accumulation_and_async_allreduce",
    "LinearWithFrozenWeight",
    "linear_with_frozen_weight",
    "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
    "allreduce_sequence_parallel_grads",
    "copy_gtp_attributes",  # megatron-core 0.19
    "param_is_not_gtp_duplicate",  # megatron-core 0.19
]
# --- end section: layers.py ---

# --- section: inference_layers.py (Transformer Engine layers in megatron-core) ---
from megatron_core.tensor_parallel.inference_layers import (  # noqa: E402
    InferenceColumnParallelLinear,
    InferenceLayerNormColumnParallelLinear,
    InferenceRowParallelLinear,
)

__all__ += [
    "InferenceLayerNormColumnParallelLinear",
    "InferenceRowParallelLinear",
    "InferenceColumnParallelLinear",  # megatron-core 0.19
]
# --- end section: inference_layers.py ---

# --- section: cross_entropy.py (owner: mappings) ---
from megatron_core.tensor_parallel.cross_entropy import (  # noqa: E402
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)

__all__ += ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]
# --- end section: cross_entropy.py ---

# --- section: data.py (owner: mappings) ---
from megatron_core.tensor_parallel.data import broadcast_data  # noqa: E402

__all__ += ["broadcast_data"]
# --- end section: data.py ---

# --- section: random.py (owner: rng) ---
from megatron_core.tensor_parallel.random import (  # noqa: E402
    CudaRNGStatesTracker,
    InferenceCudaRNGStatesTracker,
    RNGSnapshot,
    convert_cuda_rng_state,
    get_all_rng_states,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_gtp_remat_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
    get_rng_snapshot,
    initialize_rng_tracker,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    set_rng_snapshot,
)
from megatron_core.tensor_parallel.rng_state import (  # noqa: E402
    RNGAuditReport,
    audit_rng_streams,
    get_rng_state_dict,
    set_rng_state_dict,
)

__all__ += [
    "CudaRNGStatesTracker",
    "InferenceCudaRNGStatesTracker",
    "RNGSnapshot",
    "get_all_rng_states",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_gtp_remat_rng_tracker_name",  # megatron-core 0.19
    "get_model_parallel_rng_tracker_name",
    "get_rng_snapshot",
    "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "set_rng_snapshot",
    "convert_cuda_rng_state",
    "is_graph_safe_cuda_rng_tracker",
    # rng_state.py (the audit and save/load half of the RNG work)
    "RNGAuditReport",
    "audit_rng_streams",
    "get_rng_state_dict",
    "set_rng_state_dict",
]
# --- end section: random.py ---

# --- section: checkpointing.py (owner: checkpoint) ---
from megatron_core.tensor_parallel.recompute import (  # noqa: E402
    CheckpointWithoutOutput,
    CheckpointWithoutOutputFunction,
    Distribute,
    RecomputeMethod,
    capture_saved_inputs,
    checkpoint,
    checkpoint_layer_stack,
    checkpoint_sequential,
    is_checkpointing,
    set_checkpoint_early_stop,
)

__all__ += [
    "checkpoint",
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputFunction",
    "Distribute",
    "RecomputeMethod",
    "checkpoint_layer_stack",
    "checkpoint_sequential",
    "capture_saved_inputs",
    "is_checkpointing",
    "set_checkpoint_early_stop",
]
# --- end section: checkpointing.py ---

# --- section: memory.py (owner: bench) ---
from megatron_core.tensor_parallel.recompute import (  # noqa: E402
    SavedActivationReport,
    count_saved_activations,
)

__all__ += ["count_saved_activations", "SavedActivationReport"]
# --- end section: memory.py ---
