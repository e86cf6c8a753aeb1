"""TransformerConfig: the model options of megatron-core's TransformerConfig that this GPT uses.

Field names, meanings and defaults follow ``megatron.core.transformer.TransformerConfig``; the
parallelism fields are inherited from :class:`~megatron_core.ModelParallelConfig`. Validation runs
in ``__post_init__`` and raises :class:`~megatron_core.errors.MegatronCoreError` naming the values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_core.attention import check_backend
from megatron_core.context_parallel import CP_COMM_TYPES
from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig

__all__ = ["TransformerConfig", "init_method_normal", "scaled_init_method_normal"]

_GRANULARITIES = (None, "full", "selective")
_METHODS = (None, "uniform", "block")
# recompute_modules this GPT implements: megatron-core 0.16's names for a dense GPT, plus
# "activation" (the MLP's gelu, output-discarding like 0.16's "moe_act" for MoE experts).
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "activation")
# megatron-core 0.16 names for parts this GPT does not have.
_ABSENT_MODULES = {
    "moe_act": "MoE experts",
    "moe": "an MoE layer",
    "shared_experts": "MoE shared experts",
    "mla_up_proj": "multi-latent attention",
}


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init method filling a tensor from N(0, sigma^2) (megatron-core's name)."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(
    sigma: float, num_layers: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(2 num_layers))^2), for the layers that write into the residual stream."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Shape, regularization, initialization and recompute options of a transformer.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width h.
        num_attention_heads: attention heads; a multiple of tensor_model_parallel_size.
        ffn_hidden_size: MLP width; default 4 * hidden_size.
        kv_channels: width of one head; default hidden_size / num_attention_heads.
        hidden_dropout: dropout on the outputs of attention and MLP (and of the embeddings).
        attention_dropout: dropout on the attention probabilities.
        layernorm_epsilon: LayerNorm epsilon.
        add_bias_linear: give the linear layers a bias.
        init_method_std: standard deviation of the weight init.
        init_method: init of the weights that read the residual stream; default
            N(0, init_method_std^2).
        output_layer_init_method: init of the weights that write into the residual stream
            (attention output, second MLP linear); default N(0, (init_method_std /
            sqrt(2 num_layers))^2).
        recompute_granularity: None, "selective" (recompute the parts in recompute_modules) or
            "full" (recompute whole layers, see recompute_method).
        recompute_modules: with "selective", what to recompute (megatron-core 0.16's names;
            default ["core_attn"]): "core_attn" (scores, softmax, dropout, weighted sum:
            checkpoint), "mlp" (the whole MLP: checkpoint), "layernorm" (both LayerNorms: their
            outputs are released after the next linear used them and recomputed in backward,
            CheckpointWithoutOutput), "activation" (extension: the MLP's gelu output, released
            the same way). 0.16's "moe_act", "moe", "shared_experts", "mla_up_proj" raise: this
            GPT has no MoE or MLA.
        recompute_method: with "full": "uniform" (checkpoint chunks of recompute_num_layers
            layers) or "block" (checkpoint the first recompute_num_layers layers).
        recompute_num_layers: the n of recompute_method.
        distribute_saved_activations: with "full": keep each checkpoint's input split across
            the tensor-parallel group. Not with sequence parallelism.
        cp_comm_type: with context_parallel_size > 1, how the core attention reaches the other
            ranks' keys: "p2p" (ring), "all_gather" or "a2a" (NOTE [ Context parallelism ]).
            Attention dropout must be 0 with "a2a".
        attention_backend: "auto" (torch's fused attention kernels where the inputs allow, the
            unfused computation otherwise, named in the log), "fused" (or an error) or
            "unfused" (the scores materialized): NOTE [ Fused attention ].
    """

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    add_bias_linear: bool = True
    init_method_std: float = 0.02
    init_method: Callable | None = None
    output_layer_init_method: Callable | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    distribute_saved_activations: bool = False
    recompute_modules: list[str] | None = None
    cp_comm_type: str = "p2p"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_shapes()
        self._check_recompute()
        self._check_pipeline()
        self._check_context_parallel()
        self.attention_backend = check_backend(self.attention_backend, "TransformerConfig")
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, self.num_layers
            )

    def _check_shapes(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MegatronCoreError(f"TransformerConfig: {name} ({value!r}) must be >= 1")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise MegatronCoreError(
                    f"TransformerConfig: num_attention_heads ({self.num_attention_heads}) must "
                    f"divide hidden_size ({self.hidden_size})"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        tp = self.tensor_model_parallel_size
        for name in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise MegatronCoreError(
                    f"TransformerConfig: {name} ({getattr(self, name)}) must be divisible by "
                    f"tensor_model_parallel_size ({tp})"
                )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise MegatronCoreError(
                    f"TransformerConfig: {name} ({getattr(self, name)!r}) must be in [0, 1)"
                )

    def _check_context_parallel(self) -> None:
        cp = self.context_parallel_size
        if cp == 1:
            return
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise MegatronCoreError(
                f"TransformerConfig: cp_comm_type ({self.cp_comm_type!r}) must be one of "
                f"{CP_COMM_TYPES}"
            )
        if self.attention_dropout and self.cp_comm_type == "a2a":
            raise MegatronCoreError(
                f"TransformerConfig: attention_dropout ({self.attention_dropout}) with "
                f"cp_comm_type 'a2a' is not supported (NOTE [ Fused attention ], rule 4); set it "
                "to 0 or use 'p2p' / 'all_gather'"
            )
        heads = self.num_attention_heads // self.tensor_model_parallel_size
        if self.cp_comm_type == "a2a" and heads % cp:
            raise MegatronCoreError(
                f"TransformerConfig: cp_comm_type 'a2a' needs the heads per tensor-parallel rank "
                f"({heads}) divisible by context_parallel_size ({cp})"
            )

    def _check_pipeline(self) -> None:
        pp, vp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        chunks = pp * (vp or 1)
        if self.num_layers % chunks:
            what = f"pipeline_model_parallel_size ({pp})"
            if vp is not None:
                what += f" * virtual_pipeline_model_parallel_size ({vp})"
            raise MegatronCoreError(
                f"TransformerConfig: num_layers ({self.num_layers}) must be divisible by {what}"
            )

    def _check_recompute_modules(self) -> None:
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]  # megatron-core's default
        modules = self.recompute_modules
        if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
            raise MegatronCoreError(
                f"TransformerConfig: recompute_modules ({modules!r}) must be a list of names"
            )
        if self.recompute_granularity != "selective":
            return
        for name in modules:
            if name in _ABSENT_MODULES:
                raise MegatronCoreError(
                    f"TransformerConfig: recompute_modules entry {name!r} needs "
                    f"{_ABSENT_MODULES[name]}, which this GPT does not have; choose from "
                    f"{list(RECOMPUTE_MODULES)}"
                )
            if name not in RECOMPUTE_MODULES:
                raise MegatronCoreError(
                    f"TransformerConfig: recompute_modules entry {name!r} is not one of "
                    f"{list(RECOMPUTE_MODULES)}"
                )

    def recomputes(self, module: str) -> bool:
        """True when ``recompute_granularity="selective"`` recomputes ``module``."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def _check_recompute(self) -> None:
        self._check_recompute_modules()
        granularity, method, n = (
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
        )
        if granularity not in _GRANULARITIES:
            raise MegatronCoreError(
                f"TransformerConfig: recompute_granularity ({granularity!r}) must be one of "
                f"{_GRANULARITIES}"
            )
        if method not in _METHODS:
            raise MegatronCoreError(
                f"TransformerConfig: recompute_method ({method!r}) must be one of {_METHODS}"
            )
        if granularity != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    raise MegatronCoreError(
                        f"TransformerConfig: {name} ({getattr(self, name)!r}) needs "
                        f"recompute_granularity='full' (got {granularity!r})"
                    )
            if self.distribute_saved_activations:
                raise MegatronCoreError(
                    "TransformerConfig: distribute_saved_activations (True) needs "
                    f"recompute_granularity='full' (got {granularity!r})"
                )
            return
        if method is None or n is None:
            raise MegatronCoreError(
                f"TransformerConfig: recompute_granularity='full' needs recompute_method "
                f"('uniform' or 'block', got {method!r}) and recompute_num_layers (got {n!r})"
            )
        least = 1 if method == "uniform" else 0
        if isinstance(n, bool) or not isinstance(n, int) or not least <= n <= self.num_layers:
            raise MegatronCoreError(
                f"TransformerConfig: recompute_num_layers ({n!r}) must be an integer in "
                f"[{least}, num_layers ({self.num_layers})] for recompute_method {method!r}"
            )
        if self.distribute_saved_activations and self.sequence_parallel:
            raise MegatronCoreError(
                "TransformerConfig: distribute_saved_activations (True) cannot be used with "
                "sequence_parallel (True): the saved activations are already split"
            )
