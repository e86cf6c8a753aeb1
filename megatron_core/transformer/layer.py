"""TransformerLayer (pre-LayerNorm, residuals) and TransformerBlock (the stack, with recompute).

# NOTE [ Dropout streams ]
1. Replicated activations (the hidden states between layers without sequence parallelism: the
   same [s, b, h] on every TP rank) get their dropout from the device stream inside
   ``device_rng()``, which is equal across a TP group, so every rank drops the same units and
   the replicas stay equal. On cpu that stream is kept apart from the CPU generator, so a host
   draw that only some TP ranks make (a data loader on TP rank 0) cannot move it
   (NOTE [ RNG streams ], rule 6).
2. Split activations get their dropout inside ``get_cuda_rng_tracker().fork()``
   ("model-parallel-rng", distinct per TP rank): the attention probabilities (split by heads)
   and, under sequence parallelism, the hidden states themselves ([s/tp, b, h], each rank its
   own part of the sequence).
3. Each dropout call forks on its own (megatron-core instead wraps the whole layer stack in one
   fork under sequence parallelism). Both are correct under recompute: an RNG snapshot records
   the active fork and a recompute replays at that fork depth (NOTE [ RNG streams ], rule 5;
   tests/tensor_parallel/recompute/test_checkpointing.py checks a checkpoint taken inside a
   fork). Per-call forks keep the stream each draw uses visible where the draw happens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import device_rng, get_cuda_rng_tracker
from megatron_core.tensor_parallel.recompute import (
    CheckpointWithoutOutput,
    checkpoint,
    checkpoint_layer_stack,
)
from megatron_core.transformer.attention import ParallelAttention
from megatron_core.transformer.config import TransformerConfig
from megatron_core.transformer.mlp import ParallelMLP

__all__ = [
    "TransformerLayer",
    "TransformerBlock",
    "make_layer_norm",
    "dropout_rng_context",
    "get_num_layers_to_build",
    "get_transformer_layer_offset",
]


def make_layer_norm(config: TransformerConfig) -> torch.nn.LayerNorm:
    """A LayerNorm over hidden_size; its parameters carry ``sequence_parallel`` under SP.

    Under sequence parallelism each rank normalizes only its part of the sequence, so the
    gradients of the (replicated) weight and bias are partial sums: they must be all-reduced
    over the TP group (``tensor_parallel.allreduce_sequence_parallel_grads``) before the
    optimizer step.
    """
    where = {} if config.use_cpu_initialization else {"device": device.current_device()}
    norm = torch.nn.LayerNorm(
        config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype, **where
    )
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def dropout_rng_context(config: TransformerConfig) -> contextlib.AbstractContextManager:
    """Where dropout on hidden states draws from: see NOTE [ Dropout streams ], rules 1-3."""
    return get_cuda_rng_tracker().fork() if config.sequence_parallel else device_rng()


class TransformerLayer(torch.nn.Module):
    """x + dropout(attn(LN(x))), then + dropout(mlp(LN(.))): a pre-LayerNorm GPT layer.

    Selective recompute (``recompute_granularity="selective"``, megatron-core's
    ``recompute_modules``): "layernorm" releases each LayerNorm's output once the next linear
    used it and recomputes it in backward from a gradient hook on the attention / MLP output
    (``CheckpointWithoutOutput``); "mlp" runs the MLP as one non-reentrant checkpoint;
    "core_attn" and "activation" act inside attention and MLP. Every mode is bitwise equal to
    no recompute (RNG replay: NOTE [ Checkpoint rules ], rule 2).

    Args:
        config: the model's TransformerConfig.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.input_layernorm = make_layer_norm(config)
        self.self_attention = ParallelAttention(config)
        self.post_attention_layernorm = make_layer_norm(config)
        self.mlp = ParallelMLP(config)
        self.recompute_layernorm = config.recomputes("layernorm")
        self.recompute_mlp = config.recomputes("mlp")

    def set_selective_recompute(self, modules) -> None:
        """Recompute exactly ``modules`` (megatron-core's selective names, a subset of
        "core_attn", "mlp", "layernorm", "activation") in this layer from now on, whatever the
        config says; an empty set recomputes nothing (a recompute plan's per-layer choice)."""
        modules = set(modules)
        unknown = modules - {"core_attn", "mlp", "layernorm", "activation"}
        if unknown:
            raise MegatronCoreError(
                f"TransformerLayer.set_selective_recompute: unknown modules {sorted(unknown)}"
            )
        self.recompute_layernorm = "layernorm" in modules
        self.recompute_mlp = "mlp" in modules
        self.self_attention.checkpoint_core_attention = "core_attn" in modules
        self.mlp.recompute_activation = "activation" in modules and "mlp" not in modules

    def _bias_dropout_add(self, x, bias, residual):
        if bias is not None:
            x = x + bias
        with dropout_rng_context(self.config):  # NOTE [ Dropout streams ]
            x = F.dropout(x, p=self.config.hidden_dropout, training=self.training)
        return residual + x

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Map [s, b, h] ([s/tp, b, h] under sequence parallelism) to the same shape."""
        normed, norm = self._norm(self.input_layernorm, hidden_states)
        attention, bias = self.self_attention(normed)
        if norm is not None:
            norm.discard_output_and_register_recompute(attention)
        hidden_states = self._bias_dropout_add(attention, bias, hidden_states)
        normed, norm = self._norm(self.post_attention_layernorm, hidden_states)
        if self.recompute_mlp:
            mlp, bias = checkpoint(self.mlp, False, normed, use_reentrant=False)
        else:
            mlp, bias = self.mlp(normed)
        if norm is not None:
            norm.discard_output_and_register_recompute(mlp)
        return self._bias_dropout_add(mlp, bias, hidden_states)

    def _norm(self, layer_norm, hidden_states):
        """LayerNorm, under CheckpointWithoutOutput with selective "layernorm" recompute."""
        if not (self.recompute_layernorm and torch.is_grad_enabled()):
            return layer_norm(hidden_states), None
        norm = CheckpointWithoutOutput()
        return norm.checkpoint(layer_norm, hidden_states), norm


def get_num_layers_to_build(config: TransformerConfig, vp_stage: int | None = None) -> int:
    """Layers of one model chunk: num_layers / (pp * vp) (megatron-core's name).

    ``config.num_layers`` is the whole model's; the config's validation guarantees divisibility.
    """
    vp = config.virtual_pipeline_model_parallel_size or 1
    return config.num_layers // (config.pipeline_model_parallel_size * vp)


def get_transformer_layer_offset(config: TransformerConfig, vp_stage: int | None = None) -> int:
    """Global index of the chunk's first layer: virtual stage ``vp_stage * pp + pp_rank`` times
    the layers per chunk (NOTE [ Interleaved 1F1B ] in pipeline_parallel/interleaved.py)."""
    pp = config.pipeline_model_parallel_size
    if pp == 1:
        return 0
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    state_pp = parallel_state.get_pipeline_model_parallel_world_size()
    if state_pp != pp:
        raise MegatronCoreError(
            f"TransformerBlock: config.pipeline_model_parallel_size ({pp}) differs from "
            f"parallel_state's pipeline size ({state_pp})"
        )
    vp = config.virtual_pipeline_model_parallel_size
    if vp is not None and (vp_stage is None or not 0 <= vp_stage < vp):
        raise MegatronCoreError(
            f"TransformerBlock: vp_stage ({vp_stage!r}) must be in [0, "
            f"virtual_pipeline_model_parallel_size ({vp})) under interleaving"
        )
    return ((vp_stage or 0) * pp + pp_rank) * get_num_layers_to_build(config, vp_stage)


class TransformerBlock(torch.nn.Module):
    """This chunk's TransformerLayers and, on the last stage, the final LayerNorm.

    Without pipelining the chunk is the whole model (``config.num_layers`` layers). Under
    pipeline parallelism it holds ``num_layers / (pp * vp)`` layers starting at global layer
    ``layer_offset``; a chunk that is not the model's first (``pre_process=False``) reads its
    input from :meth:`set_input_tensor` (the activation received from the previous stage), and
    only the model's last chunk (``post_process=True``) applies the final LayerNorm.

    With ``recompute_granularity="full"`` the layers run through
    ``tensor_parallel.checkpoint_layer_stack`` with the config's recompute_method,
    recompute_num_layers and distribute_saved_activations (megatron-core's full recompute).

    Args:
        config: the model's TransformerConfig.
        pre_process: this chunk is the model's first (takes ``hidden_states`` from the caller).
        post_process: this chunk is the model's last (applies the final LayerNorm).
        vp_stage: the chunk's virtual stage under interleaving, else None.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.layer_offset = get_transformer_layer_offset(config, vp_stage)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config) for _ in range(get_num_layers_to_build(config, vp_stage))
        )
        self.final_layernorm = make_layer_norm(config) if post_process else None
        self.input_tensor = None
        self.layer_recompute: list[str] | None = None  # set_layer_recompute's full choices
        self.probe = None  # a recompute planner's marks (recompute/planner/probe.py), else None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """The activation [s, b, h] ([s/tp, b, h] under SP) received from the previous stage."""
        self.input_tensor = input_tensor

    def set_layer_recompute(self, choices) -> None:
        """Give each layer its own recompute (a recompute plan, in layer order): "none",
        "full" (the layer is one checkpoint: only its input is kept), "full_distributed" (the
        same, the input split over the TP group: not with sequence parallelism), or
        "selective:" followed by "+"-joined module names (e.g. "selective:core_attn+layernorm").
        Replaces the config's recompute for this chunk; ``None`` goes back to the config's.
        Raises MegatronCoreError (changing nothing) for a wrong count or an unknown choice."""
        if choices is None:
            self.layer_recompute = None
            selective = self.config.recompute_granularity == "selective"
            modules = self.config.recompute_modules if selective else ()
            for layer in self.layers:
                layer.set_selective_recompute(modules)
            return
        choices = list(choices)
        if len(choices) != len(self.layers):
            raise MegatronCoreError(
                f"TransformerBlock.set_layer_recompute: {len(choices)} choices for "
                f"{len(self.layers)} layers"
            )
        parsed = []
        for choice in choices:
            kind, _, modules = str(choice).partition(":")
            if kind == "full_distributed" and self.config.sequence_parallel:
                raise MegatronCoreError(
                    "TransformerBlock.set_layer_recompute: 'full_distributed' with sequence "
                    "parallelism (the checkpoint input is already split)"
                )
            known = {"core_attn", "mlp", "layernorm", "activation"}
            whole = kind in ("none", "full", "full_distributed") and not modules
            part = kind == "selective" and modules and set(modules.split("+")) <= known
            if not (whole or part):
                raise MegatronCoreError(
                    f"TransformerBlock.set_layer_recompute: choice {choice!r} is not 'none', "
                    "'full', 'full_distributed' or 'selective:<module>+...' (modules: "
                    f"{sorted(known)})"
                )
            parsed.append((kind, modules.split("+") if modules else ()))
        for layer, (_, modules) in zip(self.layers, parsed):
            layer.set_selective_recompute(modules)
        self.layer_recompute = [kind for kind, _ in parsed]

    def _forward_planned(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layers under :meth:`set_layer_recompute`'s choices, with the probe's marks."""
        probe = self.probe
        for index, (layer, kind) in enumerate(zip(self.layers, self.layer_recompute)):
            if probe is not None:
                probe.layer_input(index, hidden_states)
            if kind.startswith("full") and self.training and torch.is_grad_enabled():
                # megatron-core's full recompute of one layer (its "block" method, n = 1)
                hidden_states = checkpoint(layer, kind == "full_distributed", hidden_states)
            else:
                hidden_states = layer(hidden_states)
            if probe is not None:
                probe.layer_output(index, hidden_states)
        return hidden_states

    def forward(self, hidden_states: torch.Tensor | None) -> torch.Tensor:
        """Run the chunk on [s, b, h] ([s/tp, b, h] under SP); same shape out. A chunk with
        ``pre_process=False`` ignores ``hidden_states`` and uses the tensor set by
        :meth:`set_input_tensor`."""
        config = self.config
        if not self.pre_process:
            hidden_states = self.input_tensor
        if self.layer_recompute is not None:
            hidden_states = self._forward_planned(hidden_states)
        elif config.recompute_granularity == "full" and self.training:
            hidden_states = checkpoint_layer_stack(
                self.layers,
                hidden_states,
                recompute_method=config.recompute_method,
                recompute_num_layers=min(config.recompute_num_layers, len(self.layers)),
                distribute_saved_activations=bool(config.distribute_saved_activations),
            )
        else:
            for layer in self.layers:
                hidden_states = layer(hidden_states)
        if self.final_layernorm is None:
            return hidden_states
        return self.final_layernorm(hidden_states)
