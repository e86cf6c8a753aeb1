"""Gradient synchronization after backward (megatron-core's ``distributed`` package, in part).

Only ``finalize_model_grads`` is provided: it works on plain modules (no DistributedDataParallel
wrapper and no gradient buffers), all-reducing ``.grad`` (or ``.main_grad``) directly.
"""

from megatron_core.distributed.finalize_model_grads import finalize_model_grads

__all__ = [
    # finalize_model_grads.py
    "finalize_model_grads",
]
