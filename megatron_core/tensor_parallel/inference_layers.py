"""megatron-core's inference-optimized linear layers, without Transformer Engine.

In megatron-core these subclass Transformer Engine's layers (``--transformer-impl
inference_optimized``): in training mode they are the TE layers; in eval mode they run a plain
matmul with sequence-parallel communication (all-gather of the input along dim 0 before a
column-parallel matmul, reduce-scatter along dim 0 after a row-parallel one). Here they subclass
this package's ColumnParallelLinear / RowParallelLinear, take megatron-core 0.19's arguments and
compute the same values on every device (NVLS symmetric-memory kernels are CUDA-only; the
collectives they accelerate are the ones used here). Differences: eval mode adds the bias when
the layer has one (megatron-core's eval path drops it; its inference specs build these layers
without bias), and the layer norm of InferenceLayerNormColumnParallelLinear is torch's.

The two region functions are the non-autograd inference collectives of 0.19, served by this
package's region functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel.layer_params import _new_param
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.linear.inference import InferenceLinear
from megatron_core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = [
    "InferenceLinear",
    "InferenceLayerNormColumnParallelLinear",
    "InferenceColumnParallelLinear",
    "InferenceRowParallelLinear",
    "inference_all_gather_from_tensor_model_parallel_region",
    "inference_reduce_scatter_to_sequence_parallel_region",
]


def _needs_sequence_parallel(layer: str, config, tp_size: int) -> None:
    if tp_size > 1 and not config.sequence_parallel:
        raise MegatronCoreError(
            f"{layer}: tensor-parallel size {tp_size} > 1 needs config.sequence_parallel=True "
            "(megatron-core's inference-optimized layers require it)"
        )


class InferenceColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linear for inference: [s/tp, b, in] -> [s, b, out/tp].

    Training mode: ColumnParallelLinear's forward. Eval mode: all-gather the sequence shards
    along dim 0 (tp > 1), multiply by this rank's weight rows, add the bias; ``gather_output``
    is not applied (as in megatron-core). Arguments as ColumnParallelLinear's (megatron-core
    0.19's list); tensor-parallel size > 1 needs ``config.sequence_parallel``.

    Raises:
        MegatronCoreError: tp > 1 without sequence parallelism, or ColumnParallelLinear's checks.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        stride: int = 1,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ):
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            gather_output=gather_output,
            stride=stride,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
            name=name,
        )
        _needs_sequence_parallel(type(self).__name__, config, self.tp_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias or None)`` in training; ``(output [s, b, out/tp], None)`` in eval."""
        if self.training:
            return super().forward(x)
        if self.tp_size > 1:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
        return torch.nn.functional.linear(x, self.weight, self.bias), None


class InferenceLayerNormColumnParallelLinear(InferenceColumnParallelLinear):
    """LayerNorm (or RMSNorm) of the input, then InferenceColumnParallelLinear.

    The norm follows ``config.normalization`` ("LayerNorm" or "RMSNorm"; default LayerNorm),
    ``config.layernorm_epsilon`` (1e-5) and ``config.layernorm_zero_centered_gamma`` (False),
    with Transformer Engine's parameter names ``layer_norm_weight`` / ``layer_norm_bias`` ([in]).
    It runs on this rank's sequence shard; under sequence parallelism its parameters carry
    ``sequence_parallel = True`` (their gradients are partial per rank, as for every norm).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        stride: int = 1,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ):
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            gather_output=gather_output,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            stride=stride,
            skip_weight_param_allocation=skip_weight_param_allocation,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
            name=name,
        )
        self.normalization = getattr(config, "normalization", "LayerNorm")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise MegatronCoreError(
                f"{type(self).__name__}: normalization ({self.normalization!r}) must be "
                "'LayerNorm' or 'RMSNorm'"
            )
        self.eps = getattr(config, "layernorm_epsilon", 1e-5)
        self.zero_centered_gamma = getattr(config, "layernorm_zero_centered_gamma", False)
        self.layer_norm_weight = _new_param(config, input_size)
        self.layer_norm_bias = _new_param(config, input_size)
        with torch.no_grad():
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            self.layer_norm_bias.zero_()
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            param.sequence_parallel = self.sequence_parallel
        if self.normalization == "RMSNorm":
            self.register_parameter("layer_norm_bias", None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        shape = (x.shape[-1],)
        if self.normalization == "RMSNorm":
            return torch.nn.functional.rms_norm(x, shape, weight, self.eps)
        return torch.nn.functional.layer_norm(x, shape, weight, self.layer_norm_bias, self.eps)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The norm of ``x`` [s/tp, b, in], then InferenceColumnParallelLinear's forward."""
        return super().forward(self._norm(x))


class InferenceRowParallelLinear(RowParallelLinear):
    """Row-parallel linear for inference: [s, b, in/tp] -> [s/tp, b, out].

    Training mode: RowParallelLinear's forward. Eval mode: multiply by this rank's weight
    columns, reduce-scatter the partial sums along dim 0 (tp > 1), add the bias. ``residual``
    is accepted for megatron-core's fused reduce-scatter + add + norm path and not used (there
    it is used only by NVLS kernels). Tensor-parallel size > 1 needs ``config.sequence_parallel``.

    Raises:
        MegatronCoreError: tp > 1 without sequence parallelism, or RowParallelLinear's checks.
    """

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
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ):
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
            name=name,
        )
        _needs_sequence_parallel(type(self).__name__, config, self.tp_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias or None)`` in training; ``(output [s/tp, b, out], None)`` in eval."""
        del residual  # see the class doc
        if self.training:
            return super().forward(x)
        out = torch.nn.functional.linear(x, self.weight)
        if self.tp_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return (out if self.bias is None else out + self.bias.to(out.dtype)), None


def inference_all_gather_from_tensor_model_parallel_region(
    x: torch.Tensor, tp_group: dist.ProcessGroup, config
) -> torch.Tensor:
    """All-gather along the last dimension over ``tp_group`` ([..., h/tp] -> [..., h]); ``x``
    itself on one rank. ``config`` is megatron-core's (its NVLS switch), not read here."""
    del config
    return gather_from_tensor_model_parallel_region(x, group=tp_group)


def inference_reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, tp_group: dist.ProcessGroup, config
) -> torch.Tensor:
    """Reduce-scatter along dim 0 over ``tp_group`` ([s, ...] partial sums -> [s/tp, ...]);
    ``x`` itself on one rank. ``config`` is megatron-core's (its NVLS switch), not read here."""
    del config
    return reduce_scatter_to_sequence_parallel_region(x, group=tp_group)
