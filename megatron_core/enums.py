"""megatron-core's enums (``megatron.core.enums``), same names, members and values (0.16.1).

``ModelType`` tells the pipeline schedules how a model is split (megatron-core 0.16 knows one kind:
``encoder_or_decoder``); ``Fp8Recipe`` / ``Fp4Recipe`` name the low-precision recipes a
``TransformerConfig`` may ask for (this package runs none of them; the names are here so that
code and configs that mention them import).
"""

from __future__ import annotations

import enum

__all__ = ["ModelType", "Fp8Recipe", "Fp4Recipe"]


class ModelType(enum.Enum):
    """How a model is laid out over pipeline stages.

    Members:
        encoder_or_decoder: one stack of layers split over the stages (GPT, BERT, ...).
    """

    encoder_or_decoder = 1

    @property
    def encoder_and_decoder(self):
        """Removed in megatron-core; reading it raises ValueError naming the replacement."""
        raise ValueError(
            f"ModelType.encoder_and_decoder was removed (read on {self!r}); "
            "use ModelType.encoder_or_decoder"
        )


class Fp8Recipe(str, enum.Enum):
    """FP8 recipes (string values): delayed, tensorwise, mxfp8, blockwise, custom."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """FP4 recipes (string values): nvfp4, custom."""

    nvfp4 = "nvfp4"
    custom = "custom"
