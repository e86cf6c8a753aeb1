"""``transformer_engine.pytorch.GroupedLinear`` (module ``pytorch.module.grouped_linear``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.transformer_engine._refuse import not_provided
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
from megatron_core.transformer_engine.pytorch.module.linear import check_dtypes, mark_parallel

__all__ = ["GroupedLinear"]


class GroupedLinear(TransformerEngineBaseModule):
    """``num_gemms`` linear layers applied to consecutive row groups: y_i = x_i A_i^T + b_i.

    Transformer Engine's signature and parameters ``weight0``, ``bias0``, ``weight1``, ...
    (registered in that order; a bias only when ``bias``). As in Transformer Engine it does no
    tensor-parallel communication (the MoE token dispatcher does): ``parallel_mode`` and the
    group only size the weights ([out / tp, in] column, [out, in / tp] row), and a bias with
    tp > 1 is refused. Each group's GEMM is ``ParallelLinear`` without communication, so
    ``fuse_wgrad_accumulation`` behaves as in ``Linear`` (NOTE [ Transformer Engine linear ],
    rule 4).

    ``in_features``, ``out_features``, ``sequence_parallel``, ``fuse_wgrad_accumulation``,
    ``tp_group``, ``tp_size``, ``get_rng_state_tracker``, ``rng_tracker_name``, ``init_method``,
    ``bias``, ``return_bias``, ``params_dtype``, ``parallel_mode``, ``device``,
    ``save_original_input`` and ``name`` are as for ``Linear``.

    Args:
        num_gemms: the number of groups (local experts).
        ub_overlap_rs, ub_overlap_ag, delay_wgrad_compute: refused when set.
        single_grouped_weight, single_grouped_bias: (Transformer Engine 2.14's one-tensor
            layout) refused when set.

    Raises:
        MegatronCoreError: a refused option, a bias with tp > 1, an unknown mode or a size the
            group does not divide.
    """

    def __init__(
        self,
        num_gemms: int,
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
        device="cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        name: str | None = None,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
    ) -> None:
        super().__init__()
        check_common_options(
            "GroupedLinear",
            parallel_mode=parallel_mode,
            ub_overlap_rs=ub_overlap_rs,
            ub_overlap_ag=ub_overlap_ag,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        if single_grouped_weight or single_grouped_bias:
            raise not_provided(
                f"GroupedLinear(single_grouped_weight={single_grouped_weight}, "
                f"single_grouped_bias={single_grouped_bias}): one grouped parameter tensor",
                "Leave moe_single_grouped_weight / moe_single_grouped_bias off",
            )
        if int(num_gemms) < 1:
            raise MegatronCoreError(f"GroupedLinear: num_gemms ({num_gemms}) must be >= 1")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms = int(num_gemms)
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.ub_name = ub_name
        self.save_original_input = save_original_input
        self.name = name
        self.tp_size = tp_size_of(tp_group, tp_size)
        if tp_group is not None or self.tp_size == 1:
            self.set_tensor_parallel_group(tp_group)
        if self.tp_size > 1 and bias:
            raise MegatronCoreError(
                f"GroupedLinear: bias=True with tensor-parallel size {self.tp_size}: the bias "
                "would be added on every rank (the communication happens outside the module)"
            )
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":
            self.out_features = split_size(
                "GroupedLinear", "out_features", out_features, self.tp_size
            )
        elif parallel_mode == "row":
            self.in_features = split_size("GroupedLinear", "in_features", in_features, self.tp_size)
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        where = resolve_device(device)
        for i in range(self.num_gemms):
            weight = torch.empty(
                self.out_features, self.in_features, device=where, dtype=params_dtype
            )
            self.register_parameter(
                f"weight{i}",
                torch.nn.Parameter(weight),
                init_fn=init_method or get_default_init_method(),
                get_rng_state_tracker=get_rng_state_tracker,
                fp8_meta_index=1 + 3 * i,
            )
            if bias:
                self.register_parameter(
                    f"bias{i}",
                    torch.nn.Parameter(
                        torch.empty(self.out_features, device=where, dtype=params_dtype)
                    ),
                    init_fn=init_method_constant(0.0),
                )
            else:
                setattr(self, f"bias{i}", torch.empty(0, device=where, dtype=params_dtype))
        self.reset_parameters(defer_init=where.type == "meta")

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Initialize the parameters (see the base class) and mark them as Transformer Engine
        does: every weight split along its ``parallel_mode`` dimension (dim 0 for None)."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        row = self.parallel_mode == "row"
        for i in range(self.num_gemms):
            mark_parallel(getattr(self, f"weight{i}"), True, 1 if row else 0)
            if self.use_bias and row:
                getattr(self, f"bias{i}").sequence_parallel = self.sequence_parallel
            elif self.use_bias and self.parallel_mode == "column":
                mark_parallel(getattr(self, f"bias{i}"), True, 0)

    def forward(self, inp: torch.Tensor, m_splits: list[int], is_first_microbatch=None):
        """Apply GEMM i to the i-th group of ``m_splits[i]`` rows of ``inp``.

        Args:
            inp: [sum(m_splits), in_features] (any trailing shape ending in in_features).
            m_splits: the rows of each group, one per GEMM.
            is_first_microbatch: see ``Linear.forward``.

        Returns:
            [sum(m_splits), out_features], or (output, [bias_i]) with ``return_bias``.

        Raises:
            MegatronCoreError: ``m_splits`` does not hold ``num_gemms`` non-negative sizes
                summing to the rows of ``inp``.
        """
        splits = [int(m) for m in m_splits]
        if len(splits) != self.num_gemms or min(splits) < 0 or sum(splits) != inp.shape[0]:
            raise MegatronCoreError(
                f"GroupedLinear: m_splits ({splits}) must hold {self.num_gemms} non-negative "
                f"sizes summing to the input's rows ({inp.shape[0]})"
            )
        dtype = self.prepare_activation_dtype(inp)
        check_dtypes("GroupedLinear", inp, [("weight0", self.weight0)])
        opts = LinearOptions(
            None, None, 1, False, self.fuse_wgrad_accumulation, is_first_microbatch
        )
        outputs = []
        for i, rows in enumerate(torch.split(inp, splits, dim=0)):
            weight = getattr(self, f"weight{i}")
            check_linear_call("GroupedLinear", rows, weight, opts)
            bias = getattr(self, f"bias{i}") if self.apply_bias else None
            outputs.append(ParallelLinear.apply(rows, weight, bias, opts))
        out = torch.cat(outputs, dim=0) if len(outputs) > 1 else outputs[0]
        if self.return_bias:
            return out, [getattr(self, f"bias{i}").to(dtype) for i in range(self.num_gemms)]
        return out
