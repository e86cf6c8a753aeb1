"""``transformer_engine.pytorch.LayerNormLinear`` (module ``pytorch.module.layernorm_linear``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron_core.transformer_engine._refuse import refuse_if_set
from megatron_core.transformer_engine.pytorch.module._common import (
    check_common_options,
    normalize,
    resolve_device,
)
from megatron_core.transformer_engine.pytorch.module.base import init_method_constant
from megatron_core.transformer_engine.pytorch.module.linear import _ParallelGemm, check_dtypes

__all__ = ["LayerNormLinear"]


class LayerNormLinear(_ParallelGemm):
    """A LayerNorm / RMSNorm followed by a linear layer: y = norm(x) A^T + b.

    Transformer Engine's signature and parameter names: ``layer_norm_weight`` (and
    ``layer_norm_bias`` for LayerNorm) of size in_features, then ``weight`` and ``bias`` as in
    :class:`~megatron_core.transformer_engine.pytorch.Linear`. Under sequence parallelism the
    norm runs on this rank's sequence shard and its output is all-gathered for the GEMM
    (NOTE [ Transformer Engine linear ], rule 1); the norm's parameters are then marked
    ``sequence_parallel`` (their gradients are partial sums over the shard, summed over the
    group by megatron-core's ``finalize_model_grads``). Its arguments are :class:`Linear`'s and
    those below.

    Args:
        eps: the norm's epsilon.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        return_layernorm_output: also return the norm's output (this rank's rows).
        return_layernorm_output_gathered: return it gathered along dim 0 under sequence
            parallelism (one more all-gather here; Transformer Engine shares the GEMM's).
        zero_centered_gamma: the scale is 1 + ``layer_norm_weight``, initialized to 0.

    Raises:
        MegatronCoreError: a refused option (NOTE [ Transformer Engine stand-in ], rule 5),
            an unknown ``parallel_mode`` or ``normalization``, or a size the group does not
            divide.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        init_method: Callable | None = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split=None,
        zero_centered_gamma: bool = False,
        device="cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        check_common_options(
            "LayerNormLinear",
            parallel_mode=parallel_mode,
            normalization=normalization,
            ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad,
            ub_bulk_wgrad=ub_bulk_wgrad,
            delay_wgrad_compute=delay_wgrad_compute,
            symmetric_ar_type=symmetric_ar_type,
            parameters_split=parameters_split,
        )
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.normalization = normalization
        self.return_bias = return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = (
            return_layernorm_output_gathered and return_layernorm_output
        )
        self.zero_centered_gamma = zero_centered_gamma
        self.symmetric_ar_type = symmetric_ar_type
        self.get_rng_state_tracker = get_rng_state_tracker
        self.name = name
        self.ub_name = ub_name
        self.eps = eps
        self._setup_parallel(
            "LayerNormLinear",
            in_features,
            out_features,
            tp_group,
            tp_size,
            parallel_mode,
            sequence_parallel,
        )
        where = resolve_device(device)
        norm_init = init_method_constant(float(not zero_centered_gamma))
        self.register_parameter(
            "layer_norm_weight",
            torch.nn.Parameter(torch.empty(self.in_features, device=where, dtype=params_dtype)),
            init_fn=norm_init,
        )
        if normalization != "RMSNorm":
            self.register_parameter(
                "layer_norm_bias",
                torch.nn.Parameter(torch.empty(self.in_features, device=where, dtype=params_dtype)),
                init_fn=init_method_constant(0.0),
            )
        else:
            self.layer_norm_bias = None
        self._make_gemm_parameters(bias, params_dtype, where, init_method, get_rng_state_tracker)
        self.reset_parameters(defer_init=where.type == "meta")

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Initialize the parameters (see the base class) and mark them: the GEMM's for tensor
        parallelism, the norm's ``sequence_parallel``."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.layer_norm_bias is not None:
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        self._mark_gemm_parameters()

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool | None = False,
        fp8_grad: bool | None = False,
    ):
        """y = norm(inp) A^T (+ b).

        Args:
            inp: [..., in_features] (under sequence parallelism this rank's [s/tp, ...] rows).
            is_first_microbatch: see :meth:`Linear.forward`.
            fp8_output, fp8_grad: refused when True.

        Returns:
            The output; with ``return_bias`` also the bias; with ``return_layernorm_output``
            also the norm's output, last: ``out``, ``(out, bias)``, ``(out, ln_out)`` or
            ``(out, bias, ln_out)``.
        """
        refuse_if_set(
            "LayerNormLinear.forward", {"fp8_output": fp8_output, "fp8_grad": fp8_grad}, "FP8"
        )
        dtype = self.prepare_activation_dtype(inp)
        params = [("layer_norm_weight", self.layer_norm_weight), ("weight", self.weight)]
        check_dtypes("LayerNormLinear", inp, params)
        ln_out = normalize(
            inp,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.normalization,
            self.eps,
            self.zero_centered_gamma,
        )
        out, bias = self._gemm("LayerNormLinear", ln_out, is_first_microbatch, dtype)
        if self.return_layernorm_output and self.return_layernorm_output_gathered:
            if self.sequence_parallel:
                ln_out = gather_from_sequence_parallel_region(ln_out, group=self.tp_group)
        result = (out,)
        if self.return_bias:
            result += (bias,)
        if self.return_layernorm_output:
            result += (ln_out,)
        return result if len(result) > 1 else out
