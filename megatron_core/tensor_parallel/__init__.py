"""Tensor parallelism: layers, communication regions, cross entropy, data, RNG, checkpointing.

Mirrors ``megatron.core.tensor_parallel``; each block below re-exports the public names of the
file its first line names and adds them to ``__all__``.
"""

__all__: list[str] = []

# From utils.py: divisibility, splitting along the last dimension, vocabulary ranges
from megatron_core.tensor_parallel.utils import (
    VocabUtility,
    divide,
    ensure_divisibility,
    split_tensor_along_last_dim,
)

__all__ += ["divide", "ensure_divisibility", "split_tensor_along_last_dim", "VocabUtility"]

# From utils.py: 1-D equal chunks (distributed saved activations)
from megatron_core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)

__all__ += ["split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor"]

# From mappings.py: the communication regions (f / g / sequence-parallel / all-to-all)
from megatron_core.tensor_parallel.mappings import (
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

# From layers.py: the parallel linear and embedding layers and their parameter attributes
from megatron_core.tensor_parallel.layers import (
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

# From inference_layers.py: the inference layers (Transformer Engine ones in megatron-core)
from megatron_core.tensor_parallel.inference_layers import (
    InferenceColumnParallelLinear,
    InferenceLayerNormColumnParallelLinear,
    InferenceRowParallelLinear,
)

__all__ += [
    "InferenceLayerNormColumnParallelLinear",
    "InferenceRowParallelLinear",
    "InferenceColumnParallelLinear",  # megatron-core 0.19
]

# From cross_entropy.py: the vocabulary-parallel cross entropy
from megatron_core.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)

__all__ += ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]

# From data.py: broadcast_data
from megatron_core.tensor_parallel.data import broadcast_data

__all__ += ["broadcast_data"]

# From random.py and rng/state.py: the RNG states tracker, seeding, snapshots, audit
from megatron_core.tensor_parallel.random import (
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
from megatron_core.tensor_parallel.rng.state import (
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
    # rng/state.py (the audit and save/load half of the RNG work)
    "RNGAuditReport",
    "audit_rng_streams",
    "get_rng_state_dict",
    "set_rng_state_dict",
]

# From recompute/: activation checkpointing (NOTE [ Checkpoint rules ])
from megatron_core.tensor_parallel.recompute import (
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

# From recompute/memory.py: saved-activation accounting
from megatron_core.tensor_parallel.recompute import (
    SavedActivationReport,
    count_saved_activations,
)

__all__ += ["count_saved_activations", "SavedActivationReport"]

# megatron-core also serves checkpoint and its siblings from tensor_parallel.random. random.py sits
# below recompute/ (a recompute replays random.py's RNG snapshots), so this face, which imports
# both, attaches them there instead of random.py importing recompute/ (no import cycle).
from megatron_core.tensor_parallel import random as _random
from megatron_core.tensor_parallel import recompute as _recompute

for _name in _recompute.RANDOM_MODULE_NAMES:
    setattr(_random, _name, getattr(_recompute, _name))
del _name
