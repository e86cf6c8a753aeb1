"""Gradient synchronization after backward (megatron-core's ``distributed`` package, in part).

Only ``finalize_model_grads`` is provided: on plain modules it all-reduces ``.grad`` (or
``.main_grad``) directly; on chunks wrapped in megatron-core's DistributedDataParallel it lets the
wrapper finish its reduction and then behaves as megatron-core's.
"""

from megatron_core.distributed.finalize_model_grads import finalize_model_grads

__all__ = [
    # finalize_model_grads.py
    "finalize_model_grads",
]
