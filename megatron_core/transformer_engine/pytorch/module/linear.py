"""``transformer_engine.pytorch.Linear`` (module ``pytorch.module.linear``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.transformer_engine._refuse import refuse_if_set
from megatron_core.transformer_engine.pytorch.module._common import (
    LinearOptions,
    ParallelLinear,
    check_common_options,
    check_linear_call,
    resolve_device,
    split_size,
    tp_size_of,
)
from megatron_core.transformer_engine.pytorch.module.base import (
    TransformerEngineBaseModule,
    get_default_init_method,
    init_method_constant,
)

__all__ = ["Linear"]


def mark_parallel(tensor: torch.Tensor, is_parallel: bool, dim: int) -> None:
    """Transformer Engine's tensor-parallel attributes (stride 1), set or reset."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = 1


class _ParallelGemm(TransformerEngineBaseModule):
    """The tensor-parallel weight and bias that ``Linear`` and ``LayerNormLinear`` share:
    sizes per ``parallel_mode``, parameter creation and marks, the GEMM call."""

    def _setup_parallel(self, owner, in_features, out_features, tp_group, tp_size, mode, sp):
        self.in_features, self.out_features = in_features, out_features
        self.tp_size = tp_size_of(tp_group, tp_size)
        if tp_group is not None or self.tp_size == 1:
            self.set_tensor_parallel_group(tp_group)
        self.parallel_mode = mode
        if mode == "column":
            self.out_features = split_size(owner, "out_features", out_features, self.tp_size)
        elif mode == "row":
            self.in_features = split_size(owner, "in_features", in_features, self.tp_size)
        self.sequence_parallel = self.tp_size > 1 and bool(sp)

    def _make_gemm_parameters(self, bias, params_dtype, where, init_method, tracker):
        self.use_bias = bias
        self.apply_bias = bias and not self.return_bias
        self.weight_names, self.bias_names = ["weight"], ["bias"]
        weight = torch.empty(self.out_features, self.in_features, device=where, dtype=params_dtype)
        self.register_parameter(
            "weight",
            torch.nn.Parameter(weight),
            init_fn=init_method or get_default_init_method(),
            get_rng_state_tracker=tracker,
            fp8_meta_index=1,
        )
        if bias:
            bias_tensor = torch.empty(self.out_features, device=where, dtype=params_dtype)
            self.register_parameter(
                "bias", torch.nn.Parameter(bias_tensor), init_fn=init_method_constant(0.0)
            )
        else:
            self.bias = torch.empty(0, device=where, dtype=params_dtype)
        # a row-parallel bias is added after the reduction (NOTE [ Transformer Engine linear ])
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias

    def _mark_gemm_parameters(self) -> None:
        row = self.parallel_mode == "row"
        mark_parallel(self.weight, True, 1 if row else 0)
        if self.use_bias and row:
            self.bias.sequence_parallel = self.sequence_parallel
        elif self.use_bias and self.parallel_mode == "column":
            mark_parallel(self.bias, True, 0)

    def _gemm(self, owner, inp, is_first_microbatch, dtype):
        """The GEMM with its communication; returns (output, bias to return or None)."""
        opts = LinearOptions(
            self.parallel_mode,
            self.tp_group,
            self.tp_size,
            self.sequence_parallel,
            self.fuse_wgrad_accumulation,
            is_first_microbatch,
        )
        check_linear_call(owner, inp, self.weight, opts)
        in_gemm = self.apply_bias and not self.gemm_bias_unfused_add
        out = ParallelLinear.apply(inp, self.weight, self.bias if in_gemm else None, opts)
        if self.gemm_bias_unfused_add:
            out = out + self.bias.to(dtype)
        return out, (self.bias.to(dtype) if self.return_bias else None)


def check_dtypes(owner: str, inp: torch.Tensor, params) -> None:
    """Outside autocast, parameters and input must share a dtype (Transformer Engine asserts)."""
    if torch.is_autocast_enabled(inp.device.type):
        return  # autocast decides
    for name, param in params:
        if param is not None and param.dtype != inp.dtype:
            raise MegatronCoreError(
                f"{owner}: input dtype {inp.dtype} and parameter {name!r} dtype {param.dtype} "
                "differ outside an autocast region"
            )


class Linear(_ParallelGemm):
    """y = x A^T + b, split over the tensor-parallel group by ``parallel_mode``.

    Transformer Engine's signature and semantics (NOTE [ Transformer Engine linear ] for the
    communication, NOTE [ Transformer Engine stand-in ] for what is refused). The weight is
    [out_features / tp, in_features] ("column"), [out_features, in_features / tp] ("row") or
    whole (None); ``bias`` is registered only when True (else an empty tensor).

    Args:
        in_features, out_features: the full (unsplit) sizes.
        sequence_parallel: the input (column) / output (row) is split along dim 0 across the
            group; also marks a row bias ``sequence_parallel``.
        fuse_wgrad_accumulation: accumulate the weight gradient into ``weight.main_grad``.
        tp_group, tp_size: the tensor-parallel group (its size wins), or only the size, with
            the group given later by ``set_tensor_parallel_group``.
        get_rng_state_tracker, rng_tracker_name: initialize the weight inside that stream.
        init_method: ``init_method(weight)``; default N(0, 0.023^2).
        bias, return_bias: learn a bias; return it instead of adding it.
        params_dtype: the parameters' dtype (default torch's).
        parallel_mode: ``"column"``, ``"row"`` or None.
        device: where the parameters are made ("meta" defers their initialization).
        save_original_input, name: accepted (the input is always saved as given).
        ub_*, delay_wgrad_compute, symmetric_ar_type, parameters_split: refused when set.

    Raises:
        MegatronCoreError: a refused option, an unknown ``parallel_mode``, or a size the group
            does not divide.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        rng_tracker_name: str | None = None,
        init_method: Callable | None = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        parameters_split=None,
        device="cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        save_original_input: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        check_common_options(
            "Linear",
            parallel_mode=parallel_mode,
            ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad,
            ub_bulk_wgrad=ub_bulk_wgrad,
            delay_wgrad_compute=delay_wgrad_compute,
            symmetric_ar_type=symmetric_ar_type,
            parameters_split=parameters_split,
        )
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.return_bias = return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.symmetric_ar_type = symmetric_ar_type
        self.save_original_input = save_original_input
        self.name = name
        self.ub_name = ub_name
        self._setup_parallel(
            "Linear", in_features, out_features, tp_group, tp_size, parallel_mode, sequence_parallel
        )
        where = resolve_device(device)
        self._make_gemm_parameters(bias, params_dtype, where, init_method, get_rng_state_tracker)
        self.reset_parameters(defer_init=where.type == "meta")

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Initialize the parameters (see the base class) and mark them for tensor parallelism."""
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            self._mark_gemm_parameters()

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool | None = False,
        fp8_grad: bool | None = False,
    ):
        """y = inp A^T (+ b), communicating as ``parallel_mode`` says.

        Args:
            inp: [..., in_features] (column + sequence parallel: this rank's [s/tp, ...] rows;
                row: the [..., in_features / tp] split input).
            is_first_microbatch: with fuse_wgrad_accumulation, True writes ``main_grad`` over
                instead of adding to it; otherwise no effect.
            fp8_output, fp8_grad: refused when True.

        Returns:
            The output [..., out_features (/ tp for column)] (row + sequence parallel: this
            rank's rows), or (output, bias) with ``return_bias``.
        """
        refuse_if_set("Linear.forward", {"fp8_output": fp8_output, "fp8_grad": fp8_grad}, "FP8")
        dtype = self.prepare_activation_dtype(inp)
        check_dtypes("Linear", inp, [("weight", self.weight)])
        out, bias = self._gemm("Linear", inp, is_first_microbatch, dtype)
        return (out, bias) if self.return_bias else out
