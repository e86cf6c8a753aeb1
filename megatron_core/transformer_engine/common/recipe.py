"""``transformer_engine.common.recipe``: the quantization recipe types.

The types exist so that code which builds a recipe before it asks for quantization
(megatron-core's ``get_fp8_recipe``, its ``TEDelayedScaling`` subclass) runs, and so that a
checkpoint whose ``_extra_state`` pickled a recipe unpickles (NOTE [ Extra state of Transformer
Engine modules ]). Using one is refused where quantization is switched on (``autocast`` and its
relatives in ``pytorch/quantization.py``); nothing here quantizes.

Fields and defaults are Transformer Engine 2.11's. As its pydantic dataclasses do, a recipe
ignores keyword arguments it does not know (megatron-core passes ``params_dtype`` and ``device``
to ``DelayedScaling``).
"""

from __future__ import annotations

import enum
import os
from typing import Any, NamedTuple

__all__ = [
    "Format",
    "MMParams",
    "QParams",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
]


class _FormatHelper(NamedTuple):
    """The largest representable value in the forward and the backward format."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 / FP4 data formats: E4M3, E5M2, HYBRID (E4M3 forward, E5M2 backward), E2M1."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class _Fields:
    """A value type with declared fields (class-level defaults) that ignores unknown keywords."""

    _FIELDS: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, value in zip(self._FIELDS, args):
            kwargs.setdefault(name, value)
        for name in self._FIELDS:
            setattr(self, name, kwargs.get(name, getattr(type(self), name)))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._FIELDS)

    __hash__ = None  # mutable, as a dataclass with eq

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._FIELDS)
        return f"recipe_type={type(self).__name__}, {fields}"


class MMParams(_Fields):
    """Matrix-multiply options of a recipe (``use_split_accumulator``)."""

    _FIELDS = ("use_split_accumulator",)
    use_split_accumulator = True


class QParams(_Fields):
    """Quantization options of a recipe's tensor (power-of-2 scales, amax epsilon, ...)."""

    _FIELDS = ("power_2_scale", "amax_epsilon", "random_hadamard_transform", "stochastic_rounding")
    power_2_scale = False
    amax_epsilon = 0.0
    random_hadamard_transform = False
    stochastic_rounding = False


class Recipe(_Fields):
    """Base of the recipes; the predicates tell which one an instance is."""

    def nvfp4(self) -> bool:
        """Whether this is the NVFP4 block-scaling recipe."""
        return isinstance(self, NVFP4BlockScaling)

    def mxfp8(self) -> bool:
        """Whether this is the MXFP8 block-scaling recipe."""
        return isinstance(self, MXFP8BlockScaling)

    def delayed(self) -> bool:
        """Whether this is the delayed-scaling FP8 recipe."""
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        """Whether this is the per-tensor current-scaling FP8 recipe."""
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        """Whether this is a per-tensor FP8 recipe (delayed or current scaling)."""
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self) -> bool:
        """Whether this is the FP8 block-scaling recipe."""
        return isinstance(self, Float8BlockScaling)

    def custom(self) -> bool:
        """Whether this is a user-defined recipe."""
        return isinstance(self, CustomRecipe)


class DelayedScaling(Recipe):
    """FP8 with scaling factors from a history of amax values (TE's default recipe)."""

    _FIELDS = (
        "margin",
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "scaling_factor_compute_algo",
        "reduce_amax",
        "fp8_dpa",
        "fp8_mha",
    )
    margin = 0
    fp8_format = Format.HYBRID
    amax_history_len = 1024
    amax_compute_algo = "max"
    scaling_factor_compute_algo = None
    reduce_amax = True
    fp8_dpa = False
    fp8_mha = False


class Float8CurrentScaling(Recipe):
    """FP8 with per-tensor scaling factors from the current amax."""

    _FIELDS = (
        "use_power_2_scales",
        "fp8_format",
        "fp8_quant_fwd_inp",
        "fp8_quant_fwd_weight",
        "fp8_quant_bwd_grad",
        "fp8_gemm_fprop",
        "fp8_gemm_dgrad",
        "fp8_gemm_wgrad",
        "fp8_dpa",
        "fp8_mha",
    )
    use_power_2_scales = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
    fp8_format = Format.HYBRID
    fp8_quant_fwd_inp = QParams(power_2_scale=use_power_2_scales)
    fp8_quant_fwd_weight = QParams(power_2_scale=use_power_2_scales)
    fp8_quant_bwd_grad = QParams(power_2_scale=use_power_2_scales)
    fp8_gemm_fprop = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad = MMParams(use_split_accumulator=True)
    fp8_dpa = False
    fp8_mha = False


class MXFP8BlockScaling(Recipe):
    """MXFP8: blocks of 32 values share a power-of-2 scale."""

    _FIELDS = ("margin", "fp8_format", "fp8_dpa", "fp8_mha")
    margin = 0
    fp8_format = Format.E4M3
    fp8_dpa = False
    fp8_mha = False


class Float8BlockScaling(Recipe):
    """FP8 with block-wise fp32 scaling factors (1-D or 2-D blocks)."""

    _FIELDS = (
        "use_f32_scales",
        "fp8_format",
        "x_block_scaling_dim",
        "w_block_scaling_dim",
        "grad_block_scaling_dim",
        "fp8_dpa",
        "fp8_mha",
    )
    use_f32_scales = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    fp8_format = Format.E4M3
    x_block_scaling_dim = 1
    w_block_scaling_dim = 2
    grad_block_scaling_dim = 1
    fp8_dpa = False
    fp8_mha = False


class NVFP4BlockScaling(Recipe):
    """NVFP4: 4-bit values with two levels of block scales."""

    _FIELDS = ("fp4_format", "fp8_format", "disable_rht", "disable_stochastic_rounding")
    fp4_format = Format.E2M1
    fp8_format = Format.E4M3
    disable_rht = os.getenv("NVTE_NVFP4_DISABLE_RHT", "0") == "1"
    disable_stochastic_rounding = os.getenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "0") == "1"


class CustomRecipe(Recipe):
    """A recipe whose quantizers a user-supplied factory makes."""

    _FIELDS = ("qfactory", "fp8_dpa", "fp8_mha")
    qfactory = None
    fp8_dpa = False
    fp8_mha = False
