"""ParallelMLP: h -> ffn (column-parallel) -> gelu -> h (row-parallel), one all-reduce forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.recompute.without_output import CheckpointWithoutOutput
from megatron_core.transformer.config import TransformerConfig

__all__ = ["ParallelMLP"]


class ParallelMLP(torch.nn.Module):
    """The transformer MLP split across the tensor-parallel group (Megatron-LM, section 3).

    The first linear is split by columns, so each rank applies gelu to its own ffn/tp slice
    without communication; the second is split by rows and sums the partial products over the
    group (all-reduce, or reduce-scatter under sequence parallelism). Its bias is returned, not
    added, so the layer can fuse bias, dropout and residual. With "activation" in the config's
    selective ``recompute_modules`` the gelu output (the second linear's saved input, ffn/tp
    wide) is released after the second linear ran and recomputed in backward
    (``CheckpointWithoutOutput``), so only the gelu input is kept.

    Args:
        config: the model's TransformerConfig.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear,
            gather_output=False,
        )
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        # Inside a recomputed MLP ("mlp") nothing of it is kept: releasing the gelu output as
        # well would only add a second recompute hook on the MLP output.
        self.recompute_activation = config.recomputes("activation") and not config.recomputes("mlp")

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply the MLP to [s, b, h] ([s/tp, b, h] under sequence parallelism).

        Returns:
            (output, bias): output has the input's shape; bias is the second linear's bias (to
            be added by the caller) or None.
        """
        intermediate, _ = self.dense_h_to_4h(hidden_states)
        if not (self.recompute_activation and torch.is_grad_enabled()):
            return self.dense_4h_to_h(F.gelu(intermediate))
        activation = CheckpointWithoutOutput()
        output, bias = self.dense_4h_to_h(activation.checkpoint(F.gelu, intermediate))
        activation.discard_output_and_register_recompute(output)
        return output, bias
