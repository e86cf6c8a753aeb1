"""Activation checkpointing (recompute): megatron-core's ``checkpoint`` and its variants.

The rules every mode follows are NOTE [ Checkpoint rules ] in entry_points.py. The family, each
file one idea:

* entry_points.py: ``checkpoint`` (reentrant and non-reentrant), ``CheckpointFunction``, the
  options (``Distribute``, ``RecomputeMethod``), ``capture_saved_inputs``, ``is_checkpointing``.
* saved_inputs.py: what a checkpoint keeps between forward and backward (whole, distributed
  across the tensor-parallel group, offloaded; one tensor's keep and rebuild, which
  deepspeed_checkpointing shares), and the RNG / autocast replay.
* nonreentrant.py: the saved-tensor-hooks mode (NOTE [ Non-reentrant recompute ]).
* without_output.py: ``CheckpointWithoutOutput`` (megatron-core's output-discarding recompute).
* stacks.py: ``checkpoint_layer_stack`` / ``checkpoint_sequential`` (uniform and block methods).
* determinism.py, debug.py: the optional determinism check and the op log of a differing
  recompute.
* memory.py: ``count_saved_activations``, the bytes autograd keeps for backward.
* planner/: the recompute planner, a memory budget in and the fastest per-layer plan that fits
  out (``plan_recompute``; NOTE [ Recompute planner ] in its face); plan.py serves its public
  names at their first path. This face does not import it.

megatron-core's paths ``tensor_parallel.checkpoint`` and ``tensor_parallel.random.checkpoint``
are served by the ``tensor_parallel`` face, which imports this package.
"""

from megatron_core.tensor_parallel.recompute.entry_points import (
    CheckpointFunction,
    Distribute,
    capture_saved_inputs,
    checkpoint,
    is_checkpointing,
    set_checkpoint_early_stop,
)
from megatron_core.tensor_parallel.recompute.memory import (
    SavedActivationReport,
    count_saved_activations,
    storage_key_and_nbytes,
)
from megatron_core.tensor_parallel.recompute.stacks import (
    RecomputeMethod,
    checkpoint_layer_stack,
    checkpoint_sequential,
)
from megatron_core.tensor_parallel.recompute.without_output import (
    CheckpointWithoutOutput,
    CheckpointWithoutOutputFunction,
)

# Names megatron-core's tensor_parallel.random also serves (attached by the tensor_parallel face).
RANDOM_MODULE_NAMES = (
    "checkpoint",
    "CheckpointFunction",
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputFunction",
    "Distribute",
    "RecomputeMethod",
    "checkpoint_layer_stack",
    "checkpoint_sequential",
    "capture_saved_inputs",
    "is_checkpointing",
    "set_checkpoint_early_stop",
)

__all__ = [
    # entry_points.py
    "checkpoint",
    "CheckpointFunction",
    "Distribute",
    "capture_saved_inputs",
    "is_checkpointing",
    "set_checkpoint_early_stop",
    # stacks.py
    "RecomputeMethod",
    "checkpoint_layer_stack",
    "checkpoint_sequential",
    # without_output.py
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputFunction",
    # memory.py
    "SavedActivationReport",
    "count_saved_activations",
    "storage_key_and_nbytes",
]
