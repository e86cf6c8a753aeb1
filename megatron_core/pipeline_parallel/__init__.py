"""Pipeline parallelism: megatron-core's schedules, p2p communication and stage utilities.

``get_forward_backward_func()`` returns the schedule for parallel_state's pipeline:
``forward_backward_no_pipelining`` (pp == 1), ``forward_backward_pipelining_without_interleaving``
(1F1B) or ``forward_backward_pipelining_with_interleaving`` (virtual stages). The stages exchange
[s, b, h] activations and their gradients through :class:`P2PCommunicator`.
"""

from megatron_core.pipeline_parallel import p2p_communication, schedules, utils
from megatron_core.pipeline_parallel.interleaved import (
    interleaved_chunk_order,
    interleaved_warmup_microbatches,
)
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_core.pipeline_parallel.schedules import (
    backward_step,
    custom_backward,
    deallocate_output_tensor,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_step,
    get_forward_backward_func,
    get_pp_rank_microbatches,
    get_schedule_table,
    get_tensor_shapes,
)

__all__ = [
    # schedules.py
    "get_forward_backward_func",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
    "deallocate_output_tensor",
    "custom_backward",
    "forward_step",
    "backward_step",
    "get_tensor_shapes",
    "get_pp_rank_microbatches",
    "get_schedule_table",
    # interleaved.py
    "interleaved_chunk_order",
    "interleaved_warmup_microbatches",
    # p2p_communication.py
    "P2PCommunicator",
    # submodules
    "p2p_communication",
    "schedules",
    "utils",
]
