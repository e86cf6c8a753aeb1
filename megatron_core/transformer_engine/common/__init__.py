"""``transformer_engine.common``: the framework-independent part (the quantization recipes)."""

from megatron_core.transformer_engine.common import recipe

__all__ = ["recipe"]
