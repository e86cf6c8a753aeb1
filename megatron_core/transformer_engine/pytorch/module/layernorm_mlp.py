"""``transformer_engine.pytorch.LayerNormMLP`` (module ``pytorch.module.layernorm_mlp``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron_core.tensor_parallel.recompute.entry_points import checkpoint as tp_checkpoint
from megatron_core.transformer_engine.pytorch.module._common import (
    LinearOptions,
    ParallelLinear,
    check_common_options,
    check_linear_call,
    normalize,
    resolve_device,
    split_size,
    tp_size_of,
)
from megatron_core.transformer_engine.pytorch.module.base import (
    TransformerEngineBaseModule,
    get_default_init_method,
    init_method_constant,
)
from megatron_core.transformer_engine.pytorch.module.linear import check_dtypes, mark_parallel

__all__ = ["LayerNormMLP"]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gated(act: Callable) -> Callable:
    """act(first half) * second half, Transformer Engine's gated-linear-unit layout."""

    def glu(x: torch.Tensor) -> torch.Tensor:
        gate, linear = x.chunk(2, dim=-1)
        return act(gate) * linear

    return glu


def _clamped_swiglu(params: dict) -> Callable:
    limit, alpha = params.get("limit", 7.0), params.get("alpha", 1.702)

    def act(x: torch.Tensor) -> torch.Tensor:
        gate, linear = x.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return gate * torch.sigmoid(alpha * gate) * (linear.clamp(-limit, limit) + 1)

    return act


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_ACTIVATIONS: dict[str, Callable] = {
    "gelu": _tanh_gelu,
    "geglu": _gated(_tanh_gelu),
    "qgelu": _quick_gelu,
    "qgeglu": _gated(_quick_gelu),
    "relu": F.relu,
    "reglu": _gated(F.relu),
    "srelu": _srelu,
    "sreglu": _gated(_srelu),
    "silu": F.silu,
    "swiglu": _gated(F.silu),
}
_GATED = ("geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")


class LayerNormMLP(TransformerEngineBaseModule):
    """norm -> FC1 -> activation -> FC2, with Transformer Engine's parameters
    ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm), ``fc1_weight``, ``fc1_bias``,
    ``fc2_weight``, ``fc2_bias``.

    FC1 holds ffn_hidden_size / tp rows (twice that for gated activations) and FC2 as many
    columns. With ``set_parallel_mode`` FC1 is column- and FC2 row-parallel (NOTE [ Transformer
    Engine linear ]); without it no communication happens. The activation is computed in fp32
    and cast to the activation dtype: ``gelu`` and ``geglu`` are tanh-approximated, ``qgelu``
    is x sigmoid(1.702 x), ``srelu`` relu(x)^2, gated forms act on the first half times the
    second, ``clamped_swiglu`` takes ``activation_params`` ``limit`` and ``alpha``.

    Args (beyond ``LayerNormLinear``'s): hidden_size, ffn_hidden_size, activation,
        activation_params, output_layer_init_method (FC2's), set_parallel_mode, checkpoint
        (recompute FC1 and the activation in backward), seq_length and micro_batch_size
        (ignored).

    Raises:
        MegatronCoreError: an unknown activation or normalization, a refused option, or a size
            the group does not divide.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker: Callable | None = None,
        tp_group=None,
        tp_size: int = 1,
        init_method: Callable | None = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: dict | None = None,
        output_layer_init_method: Callable | None = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device="cuda",
        ub_overlap_ag: bool = False,
        name: str | None = None,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        check_common_options(
            "LayerNormMLP",
            normalization=normalization,
            ub_overlap_ag=ub_overlap_ag,
            ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad,
            ub_bulk_wgrad=ub_bulk_wgrad,
            delay_wgrad_compute=delay_wgrad_compute,
            symmetric_ar_type=symmetric_ar_type,
        )
        if activation == "clamped_swiglu":
            self._act = _clamped_swiglu(activation_params or {})
        elif activation in _ACTIVATIONS:
            self._act = _ACTIVATIONS[activation]
        else:
            known = sorted([*_ACTIVATIONS, "clamped_swiglu"])
            raise MegatronCoreError(f"LayerNormMLP: activation ({activation!r}) not in {known}")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.activation, self.activation_params = activation, activation_params
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.normalization, self.eps = normalization, eps
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.set_parallel_mode, self.zero_centered_gamma = set_parallel_mode, zero_centered_gamma
        self.checkpoint, self.name = checkpoint, name
        self.get_rng_state_tracker = get_rng_state_tracker
        self.tp_size = tp_size_of(tp_group, tp_size)
        if tp_group is not None or self.tp_size == 1:
            self.set_tensor_parallel_group(tp_group)
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        self.size_per_partition = split_size(
            "LayerNormMLP", "ffn_hidden_size", ffn_hidden_size, self.tp_size
        )
        fc1_rows = 2 * self.size_per_partition if activation in _GATED else self.size_per_partition
        where = resolve_device(device)

        def parameter(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, device=where, dtype=params_dtype))

        zero = init_method_constant(0.0)
        self.register_parameter(
            "layer_norm_weight",
            parameter(hidden_size),
            init_fn=init_method_constant(float(not zero_centered_gamma)),
        )
        if normalization != "RMSNorm":
            self.register_parameter("layer_norm_bias", parameter(hidden_size), init_fn=zero)
        else:
            self.layer_norm_bias = None
        for name, shape, init in (
            ("fc1", (fc1_rows, hidden_size), init_method),
            ("fc2", (hidden_size, self.size_per_partition), output_layer_init_method),
        ):
            self.register_parameter(
                f"{name}_weight",
                parameter(*shape),
                init_fn=init or get_default_init_method(),
                get_rng_state_tracker=get_rng_state_tracker,
            )
            if bias:
                self.register_parameter(f"{name}_bias", parameter(shape[0]), init_fn=zero)
            else:
                setattr(self, f"{name}_bias", torch.empty(0, device=where, dtype=params_dtype))
        self.gemm_bias_unfused_add = set_parallel_mode and self.apply_bias
        self.reset_parameters(defer_init=where.type == "meta")

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Initialize the parameters and mark them as Transformer Engine does."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.layer_norm_bias is not None:
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        mark_parallel(self.fc1_weight, True, 0)
        mark_parallel(self.fc2_weight, True, 1)
        if self.use_bias:
            mark_parallel(self.fc1_bias, True, 0)
            if self.set_parallel_mode:
                self.fc2_bias.sequence_parallel = self.sequence_parallel

    def _options(self, mode: str, is_first_microbatch) -> LinearOptions:
        return LinearOptions(
            mode if self.set_parallel_mode else None,
            self.tp_group,
            self.tp_size,
            self.sequence_parallel,
            self.fuse_wgrad_accumulation,
            is_first_microbatch,
        )

    def _mlp(self, ln_out: torch.Tensor, is_first_microbatch) -> torch.Tensor:
        dtype = ln_out.dtype
        fc1 = self._options("column", is_first_microbatch)
        check_linear_call("LayerNormMLP", ln_out, self.fc1_weight, fc1)
        fc1_bias = self.fc1_bias if self.use_bias else None
        hidden = ParallelLinear.apply(ln_out, self.fc1_weight, fc1_bias, fc1)
        hidden = self._act(hidden.float()).to(dtype)
        fc2 = self._options("row", is_first_microbatch)
        check_linear_call("LayerNormMLP", hidden, self.fc2_weight, fc2)
        in_gemm = self.apply_bias and not self.gemm_bias_unfused_add
        return ParallelLinear.apply(
            hidden, self.fc2_weight, self.fc2_bias if in_gemm else None, fc2
        )

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        """norm -> FC1 -> activation -> FC2.

        Args:
            inp: [..., hidden_size] (this rank's rows under sequence parallelism).
            is_first_microbatch: see ``Linear.forward``.

        Returns:
            The output, followed by the FC2 bias with ``return_bias`` and the norm's output
            with ``return_layernorm_output``.
        """
        dtype = self.prepare_activation_dtype(inp)
        check_dtypes("LayerNormMLP", inp, [("fc1_weight", self.fc1_weight)])
        ln_out = normalize(
            inp,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.normalization,
            self.eps,
            self.zero_centered_gamma,
        )
        if self.checkpoint:
            out = tp_checkpoint(self._mlp, False, ln_out, is_first_microbatch)
        else:
            out = self._mlp(ln_out, is_first_microbatch)
        if self.gemm_bias_unfused_add:
            out = out + self.fc2_bias.to(dtype)
        result = (out,)
        if self.return_bias:
            result += (self.fc2_bias.to(dtype),)
        if self.return_layernorm_output:
            if self.return_layernorm_output_gathered and self.sequence_parallel:
                ln_out = gather_from_sequence_parallel_region(ln_out, group=self.tp_group)
            result += (ln_out,)
        return result if len(result) > 1 else out
