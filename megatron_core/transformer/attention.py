"""Causal self-attention with heads split across the tensor-parallel group.

The fused QKV projection is a ColumnParallelLinear whose output columns are grouped per head as
[q_1 k_1 v_1 | q_2 k_2 v_2 | ...], so the contiguous column block of rank r holds the q, k and v
of heads r*np .. (r+1)*np - 1 (np = heads / tp): each rank attends over its own heads with no
communication, and the output projection (a RowParallelLinear) sums the heads' contributions.
The same full weight therefore gives the same model for every TP size.
"""

from __future__ import annotations

import contextlib
import math

import torch

from megatron_core import parallel_state
from megatron_core.attention import dot_product_attention
from megatron_core.context_parallel import context_parallel_attention
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.random import get_cuda_rng_tracker
from megatron_core.tensor_parallel.recompute.entry_points import checkpoint
from megatron_core.tensor_parallel.utils import divide, split_tensor_along_last_dim
from megatron_core.transformer.config import TransformerConfig

__all__ = ["CoreAttention", "ParallelAttention"]


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v for this rank's heads; no parameters.

    Runs the attention core (NOTE [ Fused attention ]): torch's fused kernels where the inputs
    allow, with ``config.attention_backend`` ("auto", "fused" or "unfused"). The attention
    probabilities are split across the TP group (each rank holds its heads), so their dropout
    draws from the "model-parallel-rng" stream: the whole call runs inside
    ``get_cuda_rng_tracker().fork()`` (NOTE [ RNG streams ], rule 2), since a fused kernel
    draws its mask inside the call; different heads get independent masks, the same on every
    data-parallel replica.

    Args:
        config: the model's TransformerConfig.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm_factor = math.sqrt(config.kv_channels)
        self.attention_dropout = torch.nn.Dropout(config.attention_dropout)
        self.cp_comm_type = config.cp_comm_type if config.context_parallel_size > 1 else None
        self.backend = config.attention_backend

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attend causally.

        Args:
            query, key, value: [s, b, np, d] for this rank's np heads of width d.

        Returns:
            The context [s, b, np * d].
        """
        s, b, np_, d = query.shape
        dropout_p = self.attention_dropout.p if self.training else 0.0
        fork = get_cuda_rng_tracker().fork() if dropout_p else contextlib.nullcontext()
        with fork:
            if self.cp_comm_type is not None:  # NOTE [ Context parallelism ]: s is this rank's
                context = context_parallel_attention(
                    query, key, value, cp_group=parallel_state.get_context_parallel_group(),
                    cp_comm_type=self.cp_comm_type, softmax_scale=1.0 / self.norm_factor,
                    dropout_p=dropout_p, backend=self.backend,
                )  # fmt: skip
            else:
                context = dot_product_attention(
                    query, key, value, causal=True, softmax_scale=1.0 / self.norm_factor,
                    dropout_p=dropout_p, backend=self.backend, where="CoreAttention",
                )  # fmt: skip
        return context.reshape(s, b, np_ * d)


class ParallelAttention(torch.nn.Module):
    """Causal multi-head self-attention split by heads (Megatron-LM, section 3).

    With ``recompute_granularity="selective"`` and "core_attn" in ``recompute_modules`` (the
    default) the core attention (scores, softmax, dropout, weighted sum: the largest
    activations when it runs unfused, cheap to recompute) runs inside
    ``tensor_parallel.checkpoint``, which replays its dropout masks in backward.

    Args:
        config: the model's TransformerConfig.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        tp = config.tensor_model_parallel_size
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        projection_size = config.kv_channels * config.num_attention_heads
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size,
            3 * projection_size,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear,
            gather_output=False,
        )
        self.core_attention = CoreAttention(config)
        self.checkpoint_core_attention = config.recomputes("core_attn")
        self.dense = RowParallelLinear(
            projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over [s, b, h] ([s/tp, b, h] under sequence parallelism).

        Returns:
            (output, bias): output has the input's shape; bias is the output projection's bias
            (to be added by the caller) or None.
        """
        mixed, _ = self.query_key_value(hidden_states)  # [s, b, 3 * np * d], full sequence
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, self.heads_per_partition, 3 * self.head_dim)
        query, key, value = split_tensor_along_last_dim(mixed, 3)
        if self.checkpoint_core_attention:
            context = checkpoint(self.core_attention, False, query, key, value)
        else:
            context = self.core_attention(query, key, value)
        return self.dense(context)
