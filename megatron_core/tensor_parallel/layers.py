"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Megatron-core's names, signatures and semantics (Shoeybi et al., arXiv:1909.08053; sequence
parallelism: Korthikanti et al., arXiv:2205.05198). Forward communication goes only through the
region functions of ``mappings.py``; the linear autograd function lives in
``linear/autograd.py`` (re-exported here), what both linear layers share in ``linear/base.py``,
VocabParallelEmbedding in ``embedding.py`` and the frozen-weight function in ``linear/frozen.py``
(both re-exported too). Options come from
:class:`~megatron_core.ModelParallelConfig`; every layer uses the tensor-parallel group of
parallel_state unless given ``tp_group=``.

Weight initialization (both ways are megatron-core's):

- ``use_cpu_initialization=True``: the full (output, input) master weight is drawn in fp32 on the
  CPU by ``init_method``, cast to ``params_dtype``, and this rank keeps its slice (stride-aware,
  see :func:`_initialize_affine_weight_cpu`). The same seed gives the same full weight for every
  TP size. The parameter stays on the CPU (move the module, as with megatron-core).
- otherwise each rank draws its own shard on the current device inside the RNG tracker's
  "model-parallel-rng" stream ("expert-parallel-rng" for expert layers).

Biases are zeroed. Under sequence parallelism parameters replicated across the TP group whose
gradients are partial per rank (RowParallelLinear's bias, LayerNorm weights) carry
``param.sequence_parallel = True``; all-reduce their gradients after backward with
:func:`allreduce_sequence_parallel_grads` (megatron-core does this in finalize_model_grads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel.embedding import VocabParallelEmbedding
from megatron_core.tensor_parallel.layer_params import (  # noqa: F401  (re-exports)
    _check_divisible,
    _check_dtype,
    _check_last_dim,
    _init_shard,
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    _new_bias,
    _new_param,
    _resolve_tp_group,
    _sequence_parallel,
    allreduce_sequence_parallel_grads,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.linear.autograd import (
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron_core.tensor_parallel.linear.base import (
    _default_extra_state,
    _ParallelLinearBase,
    reduces_over_expert_groups,
)
from megatron_core.tensor_parallel.linear.frozen import (
    LinearWithFrozenWeight,
    linear_with_frozen_weight,
)
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

__all__ = [
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
    "copy_gtp_attributes",
    "param_is_not_gtp_duplicate",
]


class ColumnParallelLinear(_ParallelLinearBase):
    """Y = XA + b with A split along its output (column) dimension: A = [A_1, ..., A_p].

    Rank r holds the [output_size / p, input_size] shard A_r (stored transposed, as
    torch.nn.functional.linear expects) and computes Y_r = X A_r (+ b_r). The input enters the
    tensor-parallel region through f (identity forward, all-reduce of the gradient backward),
    fused into the linear's backward (as megatron-core does whenever TP > 1); under
    sequence parallelism the input is this rank's [s/p, b, h] shard, all-gathered along dim 0
    and its gradient reduce-scattered (see NOTE [ Overlapped linear backward ]).

    Args:
        input_size: first dimension of A (the input features).
        output_size: second dimension of A (the output features); a multiple of the TP size.
        config: the ModelParallelConfig to read options from.
        init_method: fills a weight tensor in place (e.g. ``torch.nn.init.normal_``).
        bias: add a bias (split like the output, zero-initialized).
        gather_output: all-gather the output along the last dimension, so every rank gets Y.
        stride: interleave the weight shards (see _initialize_affine_weight_cpu).
        keep_master_weight_for_test: keep the full CPU master weight in ``self.master_weight``.
        skip_bias_add: do not add the bias; return it as the second output instead.
        skip_weight_param_allocation: create no weight; forward then takes ``weight=``.
        embedding_activation_buffer: with ``config.defer_embedding_wgrad_compute``, forward
            appends its input here (up to ``config.wgrad_deferral_limit``; 0 is no limit) so
            that the caller can compute the output layer's weight gradient later.
        grad_output_buffer: with ``config.defer_embedding_wgrad_compute``, backward appends
            the output gradient here instead of computing the weight gradient.
        is_expert: an MoE expert layer: communication is left to the token dispatcher; the
            default group is the expert-tensor-parallel group.
        tp_comm_buffer_name: Transformer Engine's communication-buffer name; unused.
        disable_grad_reduce: do not all-reduce the input gradient over the group (the caller
            reduces it later, e.g. fused with other gradients, as NeMo's LoRA adapters do).
        tp_group: tensor-parallel group; default parallel_state's. The layer's TP size is this
            group's size (``config.tensor_model_parallel_size`` is not read).

    A frozen weight (``requires_grad=False``) runs through :func:`linear_with_frozen_weight`.
    The state dict holds ``_extra_state`` (None), as megatron-core's does.

    Raises:
        MegatronCoreError: output_size not divisible by the TP size, a bad stride, or
            defer_embedding_wgrad_compute without both buffers.
    """

    _TP_AXES = {"weight": 0, "bias": 0}  # NOTE [ Sharded state dict ], rule 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list[torch.Tensor] | None = None,
        grad_output_buffer: list[torch.Tensor] | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ):
        super().__init__()
        layer = "ColumnParallelLinear"
        del tp_comm_buffer_name, name  # TE's buffer name, 0.19's layer name: unused (as there)
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.disable_grad_reduce = disable_grad_reduce
        self._setup(layer, config, tp_group, is_expert, stride)
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        _check_divisible(layer, "output_size", output_size, "tensor-parallel size", self.tp_size)
        self.output_size_per_partition = output_size // self.tp_size
        _check_divisible(
            layer, "output_size per partition", self.output_size_per_partition, "stride", stride
        )
        if skip_weight_param_allocation:
            self.weight, self.master_weight = None, None
        else:
            shape = (self.output_size_per_partition, input_size)
            self._make_weight(shape, 0, init_method, stride, keep_master_weight_for_test)
        if bias:
            self.bias = _new_bias(config, self.output_size_per_partition)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            self.bias.allreduce = not reduces_over_expert_groups(config, is_expert)
        else:
            self.register_parameter("bias", None)
        # megatron-core folds the f operator's all-reduce into the linear function's backward
        # whenever TP > 1 without sequence parallelism (NOTE [ Overlapped linear backward ],
        # rule 3); config.async_tensor_model_parallel_allreduce is not read (nor is it there).
        self.allreduce_dgrad = (
            self.tp_size > 1 and not self.sequence_parallel and not disable_grad_reduce
        )
        if config.defer_embedding_wgrad_compute and (
            embedding_activation_buffer is None or grad_output_buffer is None
        ):
            raise MegatronCoreError(
                f"{layer}: config.defer_embedding_wgrad_compute (True) needs "
                "embedding_activation_buffer and grad_output_buffer lists"
            )
        self._register_load_state_dict_pre_hook(_default_extra_state)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute this rank's output columns (or all of them with gather_output).

        Args:
            input_: [s, b, input_size] ([s/tp, b, input_size] under sequence parallelism).
            weight: the [output_size / tp, input_size] weight when the layer allocated none.
            runtime_gather_output: overrides gather_output for this call when not None.

        Returns:
            (output, output_bias): output is [s, b, output_size / tp] (or [s, b, output_size]
            when gathered); output_bias is the bias when skip_bias_add, else None.
        """
        layer = "ColumnParallelLinear"
        if weight is None:
            if self.weight is None:
                raise MegatronCoreError(
                    f"{layer}: skip_weight_param_allocation is True, so forward needs weight="
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise MegatronCoreError(
                f"{layer}: supplied weight shape {tuple(weight.shape)} must be "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        _check_last_dim(layer, input_, self.input_size)
        _check_dtype(layer, input_, weight)
        expert_comm = self.explicit_expert_comm
        if (
            self.allreduce_dgrad
            or self.sequence_parallel
            or expert_comm
            or self.disable_grad_reduce
        ):
            input_parallel = input_  # the linear function communicates (or nothing does)
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        defer = self.config.defer_embedding_wgrad_compute
        limit = self.config.wgrad_deferral_limit
        if defer and (limit == 0 or len(self.embedding_activation_buffer) < limit):
            self.embedding_activation_buffer.append(input_parallel)
        output_parallel = self._forward_impl(
            input_parallel,
            weight,
            None if self.skip_bias_add else self.bias,
            self.gradient_accumulation_fusion,
            allreduce_dgrad=self.allreduce_dgrad and not expert_comm,
            sequence_parallel=self.sequence_parallel and not expert_comm,
            grad_output_buffer=self.grad_output_buffer if defer else None,
            wgrad_deferral_limit=limit if defer else 0,
            tp_group=self.tp_group,
        )
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_ParallelLinearBase):
    """Y = XA + b with A split along its input (row) dimension and X along its last dimension.

    A = [A_1; ...; A_p], X = [X_1, ..., X_p]: rank r holds the [output_size, input_size / p]
    shard and computes X_r A_r; the partial sums leave the region through g (all-reduce forward)
    or, under sequence parallelism, a reduce-scatter along dim 0 giving [s/p, b, output_size].
    The bias is replicated and added after the reduction; under sequence parallelism it carries
    ``sequence_parallel = True`` (its gradient is partial, see allreduce_sequence_parallel_grads).

    Args:
        input_size: first dimension of A; a multiple of the TP size.
        output_size: second dimension of A.
        config: the ModelParallelConfig to read options from.
        init_method: fills a weight tensor in place.
        bias: add a (replicated, zero-initialized) bias.
        input_is_parallel: the input is already split along its last dimension (e.g. the output
            of a ColumnParallelLinear); otherwise it is scattered first. Must be True under
            sequence parallelism.
        skip_bias_add: do not add the bias; return it as the second output instead.
        stride: interleave the weight shards (see _initialize_affine_weight_cpu).
        keep_master_weight_for_test: keep the full CPU master weight in ``self.master_weight``.
        is_expert: an MoE expert layer: the output is not reduced (the token dispatcher does it),
            which requires skip_bias_add; the default group is the expert-tensor-parallel group.
        tp_comm_buffer_name: Transformer Engine's communication-buffer name; unused.
        tp_group: tensor-parallel group; default parallel_state's. The layer's TP size is this
            group's size (``config.tensor_model_parallel_size`` is not read).

    A frozen weight runs through :func:`linear_with_frozen_weight`; the state dict holds
    ``_extra_state`` (None), as megatron-core's does.

    Raises:
        MegatronCoreError: input_size not divisible by the TP size, sequence parallelism without
            input_is_parallel, or an expert layer without skip_bias_add.
    """

    _TP_AXES = {"weight": 1}  # the bias is replicated (NOTE [ Sharded state dict ])

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ):
        super().__init__()
        layer = "RowParallelLinear"
        del tp_comm_buffer_name, name  # TE's buffer name, 0.19's layer name: unused (as there)
        self._setup(layer, config, tp_group, is_expert, stride)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        if self.sequence_parallel and not input_is_parallel:
            raise MegatronCoreError(
                f"{layer}: sequence_parallel (True) requires input_is_parallel=True "
                f"(got {input_is_parallel})"
            )
        if self.explicit_expert_comm and not skip_bias_add:
            raise MegatronCoreError(
                f"{layer}: is_expert (True) with tensor-parallel size {self.tp_size} and "
                f"expert_model_parallel_size {config.expert_model_parallel_size} leaves the "
                "output unreduced, so the bias cannot be added here: set skip_bias_add=True"
            )
        _check_divisible(layer, "input_size", input_size, "tensor-parallel size", self.tp_size)
        self.input_size_per_partition = input_size // self.tp_size
        _check_divisible(
            layer, "input_size per partition", self.input_size_per_partition, "stride", stride
        )
        shape = (output_size, self.input_size_per_partition)
        self._make_weight(shape, 1, init_method, stride, keep_master_weight_for_test)
        if bias:
            self.bias = _new_bias(config, output_size)
            self.bias.allreduce = not reduces_over_expert_groups(config, is_expert)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self._register_load_state_dict_pre_hook(_default_extra_state)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Multiply this rank's input columns by its weight rows and reduce over the group.

        Args:
            input_: [s, b, input_size / tp] if input_is_parallel else [s, b, input_size].

        Returns:
            (output, output_bias): output is [s, b, output_size] ([s/tp, b, output_size] under
            sequence parallelism); output_bias is the bias when skip_bias_add, else None.
        """
        layer = "RowParallelLinear"
        _check_dtype(layer, input_, self.weight)
        if self.input_is_parallel:
            _check_last_dim(layer, input_, self.input_size_per_partition)
            input_parallel = input_
        else:
            _check_last_dim(layer, input_, self.input_size)
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output_parallel = self._forward_impl(
            input_parallel,
            self.weight,
            None,
            self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=self.tp_group,
        )
        if self.explicit_expert_comm:
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(
                output_parallel, group=self.tp_group
            )
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        # Under autocast the bias joins in the output's dtype, as nn.Linear's would (linear/amp.py).
        return output + self.bias.to(output.dtype), None
