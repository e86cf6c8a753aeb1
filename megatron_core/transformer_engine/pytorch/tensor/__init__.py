"""``transformer_engine.pytorch.tensor``: the quantized tensor types, as types only.

megatron-core asks ``isinstance(param, QuantizedTensor)`` to tell FP8 parameters apart; the
stand-in never makes one (quantization is refused), so every such check answers False.
"""

import torch

__all__ = ["QuantizedTensor", "QuantizedTensorStorage"]


class QuantizedTensorStorage:
    """The storage of a quantized tensor (never instantiated by the stand-in)."""


class QuantizedTensor(torch.Tensor):
    """A quantized tensor (never instantiated by the stand-in: quantization is refused)."""
