"""``transformer_engine.pytorch.attention``: DotProductAttention and rotary embeddings."""

from megatron_core.transformer_engine.pytorch.attention import rope
from megatron_core.transformer_engine.pytorch.attention.dot_product_attention import (
    DotProductAttention,
)
from megatron_core.transformer_engine.pytorch.attention.rope import (
    RotaryPositionEmbedding,
    apply_rotary_pos_emb,
)

__all__ = ["DotProductAttention", "RotaryPositionEmbedding", "apply_rotary_pos_emb", "rope"]
