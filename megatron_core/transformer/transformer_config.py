"""megatron-core's import path for the transformer configuration.

``from megatron.core.transformer.transformer_config import TransformerConfig`` becomes
``from megatron_core.transformer.transformer_config import TransformerConfig``; the class lives in
:mod:`megatron_core.transformer.config` (it holds the fields this package's GPT uses, on top of
every :class:`~megatron_core.ModelParallelConfig` field).
"""

from megatron_core.transformer.config import TransformerConfig

__all__ = ["TransformerConfig"]
