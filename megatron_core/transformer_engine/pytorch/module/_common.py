"""What the stand-in's linear modules share: the parallel linear autograd function, norms, the
activation dtype and the checks of Transformer Engine's options (private).

# NOTE [ Transformer Engine linear ]
Y = X W^T + b on one tensor-parallel rank, W [out, in]; ``parallel_mode`` is Transformer
Engine's:
1. ``"column"``: W holds out/tp rows. Forward: under sequence parallelism X is this rank's
   sequence shard and is all-gathered along dim 0 first. Backward: dX = dY W is reduce-scattered
   along dim 0 (sequence parallel) or all-reduced (replicated input), asynchronously while dW is
   computed; dW needs the gathered X, gathered again while dX is computed (only the shard is
   saved, as Transformer Engine and megatron-core do).
2. ``"row"``: W holds in/tp columns and X is already split. Forward: the partial product is
   reduce-scattered along dim 0 (sequence parallel) or all-reduced; the bias is added after the
   sum (``gemm_bias_unfused_add``). Backward: dY is all-gathered along dim 0 under sequence
   parallelism, nothing otherwise.
3. ``None`` (or a group of one): no communication; the MoE token dispatcher and megatron-core's
   "duplicated" layers run so.
4. ``fuse_wgrad_accumulation``: dW goes into ``weight.main_grad`` (megatron-core's DDP buffer),
   computed in main_grad's dtype from upcast operands: added, or written over it when the
   call's ``is_first_microbatch`` is True or the weight has ``overwrite_main_grad = True``. If
   the weight has ``grad_added_to_main_grad`` (megatron-core's DDP sets it), that becomes True
   and the returned gradient is a cached dummy (zeros when ``zero_out_wgrad`` is set), so DDP's
   hooks fire and add nothing; otherwise the returned gradient is None.
5. Every collective depends only on arguments equal across the group (mode, sizes, which inputs
   need gradients), so the ranks issue the same ones in the same order; each is waited before
   the function returns. Wrong shapes or a missing ``main_grad`` raise before any of them.
6. dtypes: forward runs under the caller's autocast state and backward under the same one
   (NOTE [ Autocast in autograd functions ]); gradients reach their inputs in the inputs' dtypes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import device
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import _collectives as C
from megatron_core.tensor_parallel.linear.amp import custom_bwd, custom_fwd
from megatron_core.transformer_engine._refuse import not_provided, refuse_if_set

__all__: list[str] = []

PARALLEL_MODES = (None, "column", "row")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclasses.dataclass(frozen=True)
class LinearOptions:
    """How one call of :class:`ParallelLinear` communicates (NOTE [ Transformer Engine linear ])."""

    mode: str | None  # "column", "row" or None
    group: dist.ProcessGroup | None
    tp_size: int
    sequence_parallel: bool
    fuse_wgrad: bool
    first_microbatch: bool | None

    @property
    def comm(self) -> bool:
        return self.mode is not None and self.tp_size > 1


_DUMMY_WGRADS: dict[tuple, torch.Tensor] = {}


def dummy_wgrad_for(shape: tuple, dtype: torch.dtype, where, zero: bool = False) -> torch.Tensor:
    """A cached tensor of ``shape``, ``dtype`` on ``where`` (NOTE rule 4); zeros if ``zero``."""
    key = (tuple(shape), dtype, torch.device(where))
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = torch.empty(key[0], dtype=dtype, device=key[2])
    if zero:
        _DUMMY_WGRADS[key].zero_()
    return _DUMMY_WGRADS[key].detach()


def dummy_wgrad(weight: torch.Tensor, zero: bool = False) -> torch.Tensor:
    """:func:`dummy_wgrad_for` ``weight``'s shape, dtype and device."""
    return dummy_wgrad_for(tuple(weight.shape), weight.dtype, weight.device, zero)


def _weight_grad(ctx, grad_output: torch.Tensor, total_input: torch.Tensor):
    """dW = dY^T X over all leading dimensions; NOTE [ Transformer Engine linear ], rule 4."""
    grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    total_input = total_input.reshape(-1, total_input.shape[-1])
    if not ctx.opts.fuse_wgrad:
        return grad_output.t().matmul(total_input)
    weight, main_grad = ctx.weight, ctx.main_grad
    overwrite = ctx.opts.first_microbatch or getattr(weight, "overwrite_main_grad", False)
    dtype = main_grad.dtype
    main_grad.addmm_(grad_output.t().to(dtype), total_input.to(dtype), beta=0 if overwrite else 1)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return dummy_wgrad(weight, zero=getattr(weight, "zero_out_wgrad", False))
    return None


class ParallelLinear(torch.autograd.Function):
    """Transformer Engine's linear GEMM with tensor-parallel communication and fused weight
    gradients; see NOTE [ Transformer Engine linear ] for what each mode communicates."""

    @staticmethod
    @custom_fwd  # NOTE [ Autocast in autograd functions ]
    def forward(ctx, inp, weight, bias, opts: LinearOptions):
        column_sp = opts.comm and opts.mode == "column" and opts.sequence_parallel
        total = C.all_gather_first_dim(inp, opts.group) if column_sp else inp
        out = F.linear(total, weight, bias)
        if opts.comm and opts.mode == "row":
            if opts.sequence_parallel:
                out = C.reduce_scatter_first_dim(out, opts.group)
            else:
                out = C.all_reduce(out, opts.group)
        ctx.save_for_backward(inp, weight)
        ctx.opts = opts
        ctx.use_bias = bias is not None
        if opts.fuse_wgrad:
            ctx.weight, ctx.main_grad = weight, weight.main_grad
        return out

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        opts = ctx.opts
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        column = opts.comm and opts.mode == "column"
        if opts.comm and opts.mode == "row" and opts.sequence_parallel:
            grad_output = C.all_gather_first_dim(grad_output, opts.group)
        gather = None
        if column and opts.sequence_parallel and need_weight:
            gather = C.all_gather_first_dim_async(inp, opts.group)
        grad_input = grad_output.matmul(weight) if need_input else None
        total_input = gather.wait() if gather is not None else inp
        pending = None
        if grad_input is not None and column:
            if opts.sequence_parallel:
                pending = C.reduce_scatter_first_dim_async(grad_input, opts.group)
            else:
                pending = C.all_reduce_async(grad_input, opts.group, owned=True)
        grad_weight = _weight_grad(ctx, grad_output, total_input) if need_weight else None
        grad_bias = None
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        if pending is not None:
            grad_input = pending.wait()
        return grad_input, grad_weight, grad_bias, None


def check_linear_call(owner: str, inp: torch.Tensor, weight: torch.Tensor, opts: LinearOptions):
    """NOTE [ Transformer Engine linear ], rule 5: what must hold before any collective."""
    if inp.shape[-1] != weight.shape[-1]:
        raise MegatronCoreError(
            f"{owner}: input's last dimension ({inp.shape[-1]}, shape {tuple(inp.shape)}) must "
            f"equal in_features ({weight.shape[-1]})"
        )
    if opts.comm and opts.group is None:
        raise MegatronCoreError(
            f"{owner}: tp_size is {opts.tp_size} but no tensor-parallel group was given; call "
            "set_tensor_parallel_group(tp_group) before the forward pass"
        )
    if opts.fuse_wgrad and weight.requires_grad:
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None or tuple(main_grad.shape) != tuple(weight.shape):
            got = None if main_grad is None else tuple(main_grad.shape)
            raise MegatronCoreError(
                f"{owner}: fuse_wgrad_accumulation=True needs weight.main_grad of shape "
                f"{tuple(weight.shape)} (megatron-core's DDP creates it); got {got}"
            )


def activation_dtype(inp: torch.Tensor) -> torch.dtype:
    """Transformer Engine's activation dtype: autocast's where autocast is on, else the input's."""
    kind = inp.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return inp.dtype


def normalize(
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool,
    ndim: int = 1,
) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last ``ndim`` dimensions, in the activation dtype (torch's
    kernels accumulate in fp32); with ``zero_centered_gamma`` the scale is ``1 + weight``."""
    dtype = activation_dtype(inp)
    gamma = weight + 1 if zero_centered_gamma else weight
    shape = tuple(inp.shape[-ndim:])
    with torch.autocast(inp.device.type, enabled=False):
        x, gamma = inp.to(dtype), gamma.to(dtype)
        if normalization == "RMSNorm":
            return F.rms_norm(x, shape, gamma, eps)
        return F.layer_norm(x, shape, gamma, None if bias is None else bias.to(dtype), eps)


def check_common_options(owner: str, *, parallel_mode=None, normalization=None, **options):
    """Refuse, by name, the options the stand-in does not provide (NOTE [ Transformer Engine
    stand-in ], rule 5), and check the modes."""
    if parallel_mode not in PARALLEL_MODES:
        raise MegatronCoreError(
            f"{owner}: parallel_mode ({parallel_mode!r}) must be one of {PARALLEL_MODES}"
        )
    if normalization is not None and normalization not in NORMALIZATIONS:
        raise MegatronCoreError(
            f"{owner}: normalization ({normalization!r}) must be one of {NORMALIZATIONS}"
        )
    userbuffers = {k: v for k, v in options.items() if k.startswith("ub_") and k != "ub_name"}
    refuse_if_set(
        owner,
        userbuffers,
        "userbuffers (tensor-parallel communication overlapped with GEMMs)",
        "Leave tp_comm_overlap off; the layer communicates with ordinary collectives",
    )
    refuse_if_set(
        owner,
        {"delay_wgrad_compute": options.get("delay_wgrad_compute")},
        "delayed weight-gradient computation (backward_dw)",
    )
    refuse_if_set(
        owner,
        {"symmetric_ar_type": options.get("symmetric_ar_type")},
        "symmetric-memory all-reduce",
    )
    if options.get("parameters_split") is not None:
        raise not_provided(f"{owner}(parameters_split=...): weights split into named parameters")


def resolve_device(where) -> torch.device:
    """Where parameters are made, as a ``torch.device``: Transformer Engine's ``device``
    argument, its default "cuda" meaning this package's current device and an integer the
    index on this package's device type (megatron-core passes ``torch.cuda.current_device()``,
    which the switch's CPU mode answers with 0)."""
    if where is None or where == "cuda":
        return device.current_device()
    if isinstance(where, int) and not isinstance(where, bool):  # an accelerator index
        return torch.device(device.device_type(), where)
    return torch.device(where)


def split_size(owner: str, what: str, value: int, tp_size: int) -> int:
    """``value / tp_size`` for a size split over the group (raises naming both otherwise)."""
    if value % tp_size:
        raise MegatronCoreError(
            f"{owner}: {what} ({value}) is not divisible by the tensor-parallel size ({tp_size})"
        )
    return value // tp_size


def tp_size_of(tp_group, tp_size: int) -> int:
    """Transformer Engine's rule: the group's size where one is given, else ``tp_size``."""
    if tp_group is None or not dist.is_initialized():
        return int(tp_size)
    return dist.get_world_size(group=tp_group)
