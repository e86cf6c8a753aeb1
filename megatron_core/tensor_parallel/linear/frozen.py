"""The linear function for a frozen weight (``weight.requires_grad`` is False).

megatron-core's ``LinearWithFrozenWeight`` / ``linear_with_frozen_weight`` (re-exported by
``layers.py``, where megatron-core defines them). The parallel linear layers route through it when
their weight is frozen (adapters such as LoRA freeze the base weight): forward is
``Y = X W^T + b`` as in ``linear/autograd.py``, but backward computes only the input gradient, and
only the weight (not the input) is saved for backward.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import check_gtp_size
from megatron_core.tensor_parallel import _collectives
from megatron_core.tensor_parallel.linear.amp import custom_bwd, custom_fwd
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["LinearWithFrozenWeight", "linear_with_frozen_weight"]


class LinearWithFrozenWeight(torch.autograd.Function):
    """Y = X W^T + b; backward gives only dX = dY W, all-reduced over ``tp_group`` when
    ``allreduce_dgrad`` (the column-parallel f operator folded into the function).

    No gradient flows to the weight or the bias. Autocast state is replayed in backward
    (NOTE [ Autocast in autograd functions ] in linear/amp.py).
    """

    @staticmethod
    @custom_fwd
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            grad_input = _collectives.all_reduce_async(grad_input, ctx.tp_group, owned=True).wait()
        return grad_input, None, None, None, None


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: dist.ProcessGroup | None,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: None = None,
    async_grad_allreduce: bool | None = None,
    *,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """Linear layer whose weight gets no gradient (megatron-core's signature).

    Args:
        input: [..., in]; under sequence parallelism this rank's [s/tp, ...] shard, which is
            all-gathered along dim 0 first (its gradient reduce-scattered back).
        weight: [out, in], like torch.nn.functional.linear; receives no gradient.
        bias: [out] or None; receives no gradient.
        gradient_accumulation_fusion: unused (there is no weight gradient); kept so that every
            linear implementation takes the same arguments.
        allreduce_dgrad: all-reduce the input gradient over ``tp_group``. Must be False under
            sequence parallelism.
        sequence_parallel: gather the input along dim 0 before the matmul.
        tp_group: the tensor-parallel group; None means parallel_state's.
        grad_output_buffer: must be None (embedding-wgrad deferral needs a weight gradient).
        wgrad_deferral_limit: must be None, for the same reason.
        async_grad_allreduce: deprecated in megatron-core and unused; warns when given.
        gtp_remat_size: (megatron-core 0.19, where it takes async_grad_allreduce's position;
            keyword only here) the weight-remat size; only 1 (ConfigError otherwise).

    Returns:
        The output [..., out] (with the full sequence in dim 0 under sequence parallelism).

    Raises:
        MegatronCoreError: a grad_output_buffer or wgrad_deferral_limit is given,
            allreduce_dgrad together with sequence_parallel, or mismatched shapes (before any
            collective).
    """
    check_gtp_size("linear_with_frozen_weight: gtp_remat_size", gtp_remat_size)
    if async_grad_allreduce is not None:
        warnings.warn(
            "linear_with_frozen_weight: async_grad_allreduce is deprecated and unused; "
            "pass allreduce_dgrad",
            DeprecationWarning,
            stacklevel=2,
        )
    if grad_output_buffer is not None or wgrad_deferral_limit is not None:
        raise MegatronCoreError(
            f"linear_with_frozen_weight: grad_output_buffer ({type(grad_output_buffer).__name__})"
            f" and wgrad_deferral_limit ({wgrad_deferral_limit!r}) must be None: a frozen weight "
            "has no weight gradient to defer"
        )
    if allreduce_dgrad and sequence_parallel:
        raise MegatronCoreError(
            "linear_with_frozen_weight: allreduce_dgrad (True) and sequence_parallel (True) "
            "exclude each other"
        )
    if input.shape[-1] != weight.shape[-1]:
        raise MegatronCoreError(
            f"linear_with_frozen_weight: input's last dimension (shape {tuple(input.shape)}) "
            f"must equal the weight's input size (shape {tuple(weight.shape)})"
        )
    if tp_group is None and (allreduce_dgrad or sequence_parallel):
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(
            input, tensor_parallel_output_grad=True, group=tp_group
        )
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, tp_group)
