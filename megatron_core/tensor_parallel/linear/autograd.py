"""The linear autograd function behind the parallel layers: overlapped backward, fused wgrad.

``linear_with_grad_accumulation_and_async_allreduce`` is megatron-core's name and signature
(re-exported by ``layers.py``, where megatron-core defines it). Its forward communicates through
the region functions like every layer; its backward is the one place that launches collectives
directly, because it overlaps them with the matmuls (see NOTE [ Overlapped linear backward ]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import check_gtp_size
from megatron_core.tensor_parallel import _collectives as C
from megatron_core.tensor_parallel.linear.amp import custom_bwd, custom_fwd
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region

try:  # apex's fused weight-gradient GEMMs; optional, never a dependency
    import fused_weight_gradient_mlp_cuda as _apex_wgrad
except ImportError:
    _apex_wgrad = None

__all__ = [
    "LinearWithGradAccumulationAndAsyncCommunication",
    "linear_with_grad_accumulation_and_async_allreduce",
]

# NOTE [ Overlapped linear backward ]
# Y = X W^T + b on one tensor-parallel rank; X is [..., in], W is [out, in].
# 1. Forward. Under sequence parallelism X is this rank's sequence shard [s/tp, ..., in]; it is
#    all-gathered along dim 0 by gather_from_sequence_parallel_region (grad mode is off inside
#    Function.forward, so that call is plain communication). Only the shard is saved, not the
#    gathered input: backward gathers it again (rule 2), as megatron-core does, trading one
#    all-gather for s x (tp-1)/tp rows of activation memory.
# 2. Backward under sequence parallelism: launch the async all-gather of the saved shard (only
#    wgrad needs it) -> dgrad = dY W while it runs -> wait -> launch the async reduce-scatter of
#    dgrad along dim 0 -> wgrad = dY^T X_full while it runs -> wait.
# 3. Backward with allreduce_dgrad (column-parallel input replicated across TP): dgrad = dY W ->
#    launch the async all-reduce of dgrad -> wgrad while it runs -> wait. Without it (and without
#    sequence parallelism) no collective runs here; the caller's region does the communication.
# 4. wgrad sums over all leading dims. With gradient_accumulation_fusion it is added into
#    ``weight.main_grad`` and the returned weight gradient is None (weight.grad stays None):
#    apex's wgrad_gemm_accum kernel for CUDA tensors when it imports, else torch.addmm_ in
#    main_grad's dtype with the inputs upcast to it. Products of bf16/fp16 values are exact in
#    fp32, so the fallback computes what apex's fp32-accumulating GEMM computes.
# 5. Every rank issues the same collectives in the same order (they depend only on arguments that
#    are equal across the group and on needs_input_grad), and every handle is waited before
#    backward returns: no collective outlives the call.
# 6. On CUDA the overlap needs CUDA_DEVICE_MAX_CONNECTIONS=1 so that the collective is queued
#    before the matmul that should hide it (megatron-core's advice); results do not depend on it.
#    Without it the function warns once (device.warn_if_overlap_is_serialized).


def _weight_grad(grad_output, total_input, main_grad: torch.Tensor | None):
    """dY^T X over all leading dims; see NOTE [ Overlapped linear backward ], rule 4."""
    grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    total_input = total_input.reshape(-1, total_input.shape[-1])
    if main_grad is None:
        return grad_output.t().matmul(total_input)
    if _apex_wgrad is not None and total_input.device.type == "cuda":
        if main_grad.dtype == torch.float32:
            kernel = _apex_wgrad.wgrad_gemm_accum_fp32
        else:
            kernel = _apex_wgrad.wgrad_gemm_accum_fp16
        kernel(total_input.contiguous(), grad_output.contiguous(), main_grad)
    else:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))
    return None


def _defer_wgrad(buffer, limit, grad_output) -> bool:
    """Embedding-wgrad deferral (megatron-core): stash dY instead of computing wgrad now."""
    if buffer is None or not (limit == 0 or len(buffer) < limit):
        return False
    buffer.append(grad_output)
    return True


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """Y = X W^T + b with TP communication; see NOTE [ Overlapped linear backward ].

    Forward: all-gather X along dim 0 under sequence parallelism (rule 1), then the matmul.
    Backward: dgrad all-reduced (allreduce_dgrad) or reduce-scattered (sequence parallel)
    asynchronously while wgrad is computed (rules 2-3); wgrad optionally fused into main_grad.
    """

    @staticmethod
    @custom_fwd  # NOTE [ Autocast in autograd functions ] (linear/amp.py)
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
        gtp_remat_size=1,
    ):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        # The buffer itself, not weight.main_grad in backward: a saved tensor may unpack as
        # another Python object (saved-tensor hooks, recompute) without the attribute.
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion else None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.tp_group = tp_group
        if sequence_parallel:
            total_input = gather_from_sequence_parallel_region(input, group=tp_group)
        else:
            total_input = input
        # F.linear, not matmul + add: under autocast it casts the bias too, so the output has
        # nn.Linear's dtype (an fp32 bias added to a bf16 product would promote it to fp32).
        return torch.nn.functional.linear(total_input, weight, bias)

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group = ctx.tp_group
        wgrad_now = ctx.needs_input_grad[1] and not _defer_wgrad(
            ctx.grad_output_buffer, ctx.wgrad_deferral_limit, grad_output
        )
        total_input = input
        if ctx.sequence_parallel and wgrad_now:
            gather = C.all_gather_first_dim_async(input, group)  # rule 2
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.sequence_parallel and wgrad_now:
            total_input = gather.wait()
        pending = None
        if grad_input is not None and ctx.sequence_parallel:
            pending = C.reduce_scatter_first_dim_async(grad_input, group)
        elif grad_input is not None and ctx.allreduce_dgrad:
            pending = C.all_reduce_async(grad_input, group, owned=True)  # rule 3
        grad_weight = None
        if wgrad_now:
            grad_weight = _weight_grad(grad_output, total_input, ctx.main_grad)
        grad_bias = None
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        if pending is not None:
            grad_input = pending.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def _check_arguments(input, weight, bias, fusion, allreduce_dgrad, sequence_parallel) -> None:
    if input.shape[-1] != weight.shape[-1]:
        raise MegatronCoreError(
            f"linear: input's last dimension ({input.shape[-1]}, shape {tuple(input.shape)}) "
            f"must equal the weight's input size ({weight.shape[-1]}, shape "
            f"{tuple(weight.shape)})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise MegatronCoreError(
            f"linear: bias shape {tuple(bias.shape)} must be ({weight.shape[0]},)"
        )
    if allreduce_dgrad and sequence_parallel:
        raise MegatronCoreError(
            "linear: allreduce_dgrad (True) and sequence_parallel (True) exclude each other: "
            "under sequence parallelism the input gradient is reduce-scattered"
        )
    if fusion:
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None or tuple(main_grad.shape) != tuple(weight.shape):
            got = None if main_grad is None else tuple(main_grad.shape)
            raise MegatronCoreError(
                f"linear: gradient_accumulation_fusion needs weight.main_grad of shape "
                f"{tuple(weight.shape)} (an fp32 buffer, as megatron's DDP creates); got {got}"
            )


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool | None,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int = 0,
    async_grad_allreduce: bool | None = None,
    tp_group: dist.ProcessGroup | None = None,
    *,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """Linear layer with gradient-accumulation fusion and communication overlapped in backward.

    Megatron-core's function; see NOTE [ Overlapped linear backward ] for what runs when.

    Args:
        input: [..., in] (under sequence parallelism: this rank's [s/tp, ...] sequence shard).
        weight: [out, in], like torch.nn.functional.linear.
        bias: [out] or None.
        gradient_accumulation_fusion: add the weight gradient into ``weight.main_grad`` (which
            must exist) instead of returning it; uses apex's fused kernel when available.
        allreduce_dgrad: all-reduce the input gradient over ``tp_group``, overlapped with the
            weight-gradient matmul. Must be False under sequence parallelism. None takes the
            value of ``async_grad_allreduce`` (False when that is None too).
        sequence_parallel: all-gather the input along dim 0 in forward and reduce-scatter the
            input gradient along dim 0 in backward.
        grad_output_buffer: megatron-core's embedding-wgrad deferral: when given, output
            gradients are appended to it (up to ``wgrad_deferral_limit``; 0 means no limit)
            and the weight gradient is left for the caller to compute.
        wgrad_deferral_limit: see grad_output_buffer.
        async_grad_allreduce: the older name of allreduce_dgrad (megatron-core <= 0.6).
        tp_group: the tensor-parallel group; default parallel_state's (looked up only when a
            collective is needed).
        gtp_remat_size: (megatron-core 0.19, keyword only here: 0.19 dropped
            async_grad_allreduce and moved tp_group up one position) the weight-remat size;
            only 1 (ConfigError otherwise).

    Returns:
        The output [..., out] (under sequence parallelism with the full sequence in dim 0).

    Raises:
        MegatronCoreError: mismatched shapes, allreduce_dgrad together with sequence_parallel,
            or gradient_accumulation_fusion without a matching ``weight.main_grad`` (raised
            before any collective).
    """
    check_gtp_size(
        "linear_with_grad_accumulation_and_async_allreduce: gtp_remat_size", gtp_remat_size
    )
    if allreduce_dgrad is None:
        allreduce_dgrad = bool(async_grad_allreduce)
    elif async_grad_allreduce is not None and bool(async_grad_allreduce) != bool(allreduce_dgrad):
        raise MegatronCoreError(
            f"linear: async_grad_allreduce ({async_grad_allreduce}) contradicts allreduce_dgrad "
            f"({allreduce_dgrad}); pass allreduce_dgrad only"
        )
    _check_arguments(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel
    )
    if sequence_parallel:  # NOTE [ Overlapped linear backward ], rule 6
        device.warn_if_overlap_is_serialized(input, "sequence parallelism")
    elif allreduce_dgrad:
        device.warn_if_overlap_is_serialized(input, "async tensor-model-parallel all-reduce")
    if tp_group is None and (allreduce_dgrad or sequence_parallel):
        tp_group = parallel_state.get_tensor_model_parallel_group()
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
    )
