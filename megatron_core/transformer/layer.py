"""TransformerLayer (pre-LayerNorm, residuals) and TransformerBlock (the stack, with recompute).

# NOTE [ Dropout streams ]
1. Replicated activations (the hidden states between layers without sequence parallelism: the
   same [s, b, h] on every TP rank) get their dropout from the default generator, which is equal
   across a TP group, so every rank drops the same units and the replicas stay equal.
2. Split activations get their dropout inside ``get_cuda_rng_tracker().fork()``
   ("model-parallel-rng", distinct per TP rank): the attention probabilities (split by heads)
   and, under sequence parallelism, the hidden states themselves ([s/tp, b, h], each rank its
   own part of the sequence).
3. Each dropout call forks on its own (megatron-core instead wraps the whole layer stack in one
   fork under sequence parallelism). Both are correct under recompute: an RNG snapshot records
   the active fork and a recompute replays at that fork depth (NOTE [ RNG streams ], rule 5;
   tests/test_checkpointing.py checks a checkpoint taken inside a fork). Per-call forks keep the
   stream each draw uses visible where the draw happens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron_core import device
from megatron_core.tensor_parallel.checkpointing import checkpoint_layer_stack
from megatron_core.tensor_parallel.random import get_cuda_rng_tracker
from megatron_core.transformer.attention import ParallelAttention
from megatron_core.transformer.config import TransformerConfig
from megatron_core.transformer.mlp import ParallelMLP

__all__ = ["TransformerLayer", "TransformerBlock", "make_layer_norm", "dropout_rng_context"]


def make_layer_norm(config: TransformerConfig) -> torch.nn.LayerNorm:
    """A LayerNorm over hidden_size; its parameters carry ``sequence_parallel`` under SP.

    Under sequence parallelism each rank normalizes only its part of the sequence, so the
    gradients of the (replicated) weight and bias are partial sums: they must be all-reduced
    over the TP group (``tensor_parallel.allreduce_sequence_parallel_grads``) before the
    optimizer step.
    """
    where = {} if config.use_cpu_initialization else {"device": device.current_device()}
    norm = torch.nn.LayerNorm(
        config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype, **where
    )
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def dropout_rng_context(config: TransformerConfig) -> contextlib.AbstractContextManager:
    """Where dropout on hidden states draws from: see NOTE [ Dropout streams ], rules 1-3."""
    return get_cuda_rng_tracker().fork() if config.sequence_parallel else contextlib.nullcontext()


class TransformerLayer(torch.nn.Module):
    """x + dropout(attn(LN(x))), then + dropout(mlp(LN(.))): a pre-LayerNorm GPT layer.

    Args:
        config: the model's TransformerConfig.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.input_layernorm = make_layer_norm(config)
        self.self_attention = ParallelAttention(config)
        self.post_attention_layernorm = make_layer_norm(config)
        self.mlp = ParallelMLP(config)

    def _bias_dropout_add(self, x, bias, residual):
        if bias is not None:
            x = x + bias
        with dropout_rng_context(self.config):  # NOTE [ Dropout streams ]
            x = F.dropout(x, p=self.config.hidden_dropout, training=self.training)
        return residual + x

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Map [s, b, h] ([s/tp, b, h] under sequence parallelism) to the same shape."""
        attention, bias = self.self_attention(self.input_layernorm(hidden_states))
        hidden_states = self._bias_dropout_add(attention, bias, hidden_states)
        mlp, bias = self.mlp(self.post_attention_layernorm(hidden_states))
        return self._bias_dropout_add(mlp, bias, hidden_states)


class TransformerBlock(torch.nn.Module):
    """``num_layers`` TransformerLayers and the final LayerNorm.

    With ``recompute_granularity="full"`` the layers run through
    ``tensor_parallel.checkpoint_layer_stack`` with the config's recompute_method,
    recompute_num_layers and distribute_saved_activations (megatron-core's full recompute).

    Args:
        config: the model's TransformerConfig.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config) for _ in range(config.num_layers)
        )
        self.final_layernorm = make_layer_norm(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Run the stack on [s, b, h] ([s/tp, b, h] under SP); returns the normalized output."""
        config = self.config
        if config.recompute_granularity == "full" and self.training:
            hidden_states = checkpoint_layer_stack(
                self.layers,
                hidden_states,
                recompute_method=config.recompute_method,
                recompute_num_layers=config.recompute_num_layers,
                distribute_saved_activations=bool(config.distribute_saved_activations),
            )
        else:
            for layer in self.layers:
                hidden_states = layer(hidden_states)
        return self.final_layernorm(hidden_states)
