"""megatron-core's inference linear layers, which are Transformer Engine layers: not provided.

In megatron-core, ``InferenceLayerNormColumnParallelLinear`` and ``InferenceRowParallelLinear``
subclass Transformer Engine's ``TELayerNormColumnParallelLinear`` / ``TERowParallelLinear`` and
exist only where TE is installed. This package has no Transformer Engine layers, so the names are
importable (code that imports them keeps importing) and constructing one raises a
:class:`~megatron_core.errors.MegatronCoreError` that names Transformer Engine. Use
:class:`~megatron_core.tensor_parallel.ColumnParallelLinear` (after a LayerNorm) and
:class:`~megatron_core.tensor_parallel.RowParallelLinear` instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig

__all__ = ["InferenceLayerNormColumnParallelLinear", "InferenceRowParallelLinear"]


def _needs_transformer_engine(name: str) -> MegatronCoreError:
    return MegatronCoreError(
        f"{name} is a Transformer Engine layer in megatron-core (it subclasses TE's "
        f"{name.replace('Inference', 'TE')}); megatron_core has no Transformer Engine layers. "
        "Use ColumnParallelLinear / RowParallelLinear from megatron_core.tensor_parallel."
    )


class InferenceLayerNormColumnParallelLinear(torch.nn.Module):
    """Needs Transformer Engine: construction raises MegatronCoreError (see the module doc).

    The constructor takes megatron-core's arguments so that the error, not a TypeError, is what
    a caller porting megatron-core code sees.
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
    ):
        raise _needs_transformer_engine(type(self).__name__)

    def forward(self, x: torch.Tensor):
        """Never reached: construction raises."""
        raise _needs_transformer_engine(type(self).__name__)


class InferenceRowParallelLinear(torch.nn.Module):
    """Needs Transformer Engine: construction raises MegatronCoreError (see the module doc)."""

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
    ):
        raise _needs_transformer_engine(type(self).__name__)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Never reached: construction raises."""
        raise _needs_transformer_engine(type(self).__name__)
