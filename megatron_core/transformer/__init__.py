"""A small GPT built only from ``megatron_core.tensor_parallel``: the library's reference user.

Layout is megatron's [sequence, batch, hidden]; under sequence parallelism the activations
between layers are [sequence / tp, batch, hidden].
"""

from megatron_core.transformer.attention import CoreAttention, ParallelAttention
from megatron_core.transformer.config import (
    TransformerConfig,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron_core.transformer.gpt import GPTModel
from megatron_core.transformer.layer import (
    TransformerBlock,
    TransformerLayer,
    dropout_rng_context,
    make_layer_norm,
)
from megatron_core.transformer.mlp import ParallelMLP

__all__ = [
    # config.py
    "TransformerConfig",
    "init_method_normal",
    "scaled_init_method_normal",
    # mlp.py
    "ParallelMLP",
    # attention.py
    "CoreAttention",
    "ParallelAttention",
    # layer.py
    "TransformerLayer",
    "TransformerBlock",
    "make_layer_norm",
    "dropout_rng_context",
    # gpt.py
    "GPTModel",
]
