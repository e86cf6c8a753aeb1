"""InferenceLinear: megatron-core 0.19's inference version of Transformer Engine's TELinear.

One class, four ``parallel_mode`` values (TE's): None or "duplicated" (the whole [out, in]
weight on every rank, no communication), "column" (rows of the weight split over the group, the
output stays split) and "row" (columns split, the partial outputs summed). Under sequence
parallelism "column" all-gathers its [s/tp, ...] input along dim 0 and "row" reduce-scatters its
output along dim 0; otherwise "column" enters the region through f (identity forward, all-reduce
backward) and "row" leaves it through g (all-reduce forward). Training and eval compute the same
values; served from tensor_parallel.inference_layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel.layer_params import (
    _check_divisible,
    _init_shard,
    _new_bias,
    _new_param,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.linear.base import _ParallelLinearBase
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["InferenceLinear"]

_MODES = (None, "duplicated", "column", "row")


class InferenceLinear(_ParallelLinearBase):
    """A linear layer in one of TE's parallel modes (see the module doc).

    Shapes: "column" [s/tp or s, b, in] -> [s, b, out/tp]; "row" [s, b, in/tp] ->
    [s/tp or s, b, out]; None / "duplicated" [..., in] -> [..., out].

    ``config``, ``init_method``, ``bias``, ``skip_bias_add``, ``skip_weight_param_allocation``,
    ``is_expert`` and ``tp_group`` are as for ColumnParallelLinear (weights initialized the same
    way, so a "column" weight equals ColumnParallelLinear's for the same seed).

    Args:
        input_size, output_size: the full weight's sizes (split ones divisible by tp).
        parallel_mode: None, "duplicated", "column" or "row".
        tp_comm_buffer_name, symmetric_ar_type, name: Transformer Engine's; unused.

    Raises:
        MegatronCoreError: an unknown parallel_mode or a size the group does not divide.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: str | None = None,
        is_expert: bool = False,
        symmetric_ar_type: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ):
        super().__init__()
        layer = "InferenceLinear"
        del tp_comm_buffer_name, symmetric_ar_type, name
        if parallel_mode not in _MODES:
            raise MegatronCoreError(f"{layer}: parallel_mode ({parallel_mode!r}) not in {_MODES}")
        self.parallel_mode = parallel_mode
        self._setup(layer, config, tp_group, is_expert, 1)
        if parallel_mode in (None, "duplicated"):
            self.tp_rank, self.tp_size, self.sequence_parallel = 0, 1, False
        self.input_size, self.output_size, self.skip_bias_add = (
            input_size,
            output_size,
            skip_bias_add,
        )
        dim = 1 if parallel_mode == "row" else 0
        sizes = [output_size, input_size]
        _check_divisible(layer, ("output_size", "input_size")[dim], sizes[dim], "tp", self.tp_size)
        sizes[dim] //= self.tp_size
        if skip_weight_param_allocation:
            self.weight, self.master_weight = None, None
        else:
            self.weight = _new_param(config, *sizes)
            set_tensor_model_parallel_attributes(self.weight, self.tp_size > 1, dim, 1)
            self.master_weight = _init_shard(
                self.weight, config, init_method, (output_size, input_size), dim, 1,
                self.tp_rank, self.tp_size, False, is_expert,
            )  # fmt: skip
        if bias:
            self.bias = _new_bias(config, sizes[0])
            set_tensor_model_parallel_attributes(self.bias, parallel_mode == "column", 0, 1)
            self.bias.sequence_parallel = parallel_mode == "row" and self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias if skip_bias_add else None)``; shapes in the class doc."""
        group, sp = self.tp_group, self.sequence_parallel
        bias = None if self.skip_bias_add else self.bias
        if self.parallel_mode == "column" and self.tp_size > 1:
            if sp:
                x = gather_from_sequence_parallel_region(x, group=group)
            else:
                x = copy_to_tensor_model_parallel_region(x, group=group)
        if self.parallel_mode != "row" or self.tp_size == 1:
            out = torch.nn.functional.linear(x, self.weight, bias)
        else:
            out = torch.nn.functional.linear(x, self.weight)
            if sp:
                out = reduce_scatter_to_sequence_parallel_region(out, group=group)
            else:
                out = reduce_from_tensor_model_parallel_region(out, group=group)
            out = out if bias is None else out + bias.to(out.dtype)
        return out, (self.bias if self.skip_bias_add else None)
