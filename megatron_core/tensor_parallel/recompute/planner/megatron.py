"""The recompute planner on megatron-core's own TransformerBlock (megatron-core's GPTModel built
through the switch, megatron_core.megatron): which plans its TransformerConfig expresses, and
:class:`MegatronCoreBlock`, the view of its block that the probe (probe.py) drives.

megatron-core decides a layer's selective recompute when the layer is built (from
``recompute_granularity`` / ``recompute_modules``: flags of each TransformerLayer and of its
attention) and reads the full recompute's fields from the config at every forward. The view
sets both in place, for the settings megatron-core expresses, and sets the planner's marks
(:class:`~megatron_core.tensor_parallel.recompute.planner.probe.LayerMarks`) with module hooks:
nothing of megatron-core is imported here or patched; its block is recognised by its type.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from megatron_core.errors import MegatronCoreError

__all__ = [
    "MEGATRON_RECOMPUTE_MODULES",
    "MegatronCoreBlock",
    "is_megatron_core_block",
    "megatron_fields",
    "megatron_options",
]

# recompute_modules of megatron-core's TransformerConfig that a dense layer of the local spec
# (and Transformer Engine's) honours; its other names are for MoE and multi-latent attention.
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers",
           "distribute_saved_activations", "recompute_modules")  # fmt: skip
_LAYER_FLAGS = ("recompute_input_layernorm", "recompute_pre_mlp_layernorm", "recompute_mlp")


def is_megatron_core_block(module: torch.nn.Module) -> bool:
    """Whether ``module`` is megatron-core's TransformerBlock (megatron.core.transformer)."""
    cls = type(module)
    return (
        cls.__name__ == "TransformerBlock"
        and cls.__module__.startswith("megatron.core.transformer")
        and hasattr(module, "layers")
        and hasattr(module, "config")
    )


def megatron_options(tensor_parallel_size: int, sequence_parallel: bool) -> list[str]:
    """The per-layer options the planner probes on megatron-core's block, cheapest first: those
    its TransformerConfig can set on every layer (NOTE [ Recompute planner ], rules 1 and 6)."""
    options = ["none", "selective:core_attn", "selective:layernorm+core_attn",
               "selective:layernorm+core_attn+mlp", "full"]  # fmt: skip
    if tensor_parallel_size > 1 and not sequence_parallel:
        options.append("full_distributed")
    return options


def megatron_fields(choices: Sequence[str]) -> dict | None:
    """The TransformerConfig recompute fields that give per-layer ``choices``, or None where
    megatron-core cannot express them: one selective set (of
    :data:`MEGATRON_RECOMPUTE_MODULES`) or none on every layer, or full recompute (block method)
    of the first n layers and none after them."""
    choices = list(choices)
    first = choices[0]
    if first.startswith("full"):
        n = choices.count(first)
        if choices[:n] != [first] * n or any(c != "none" for c in choices[n:]):
            return None
        return {"recompute_granularity": "full", "recompute_method": "block",
                "recompute_num_layers": n,
                "distribute_saved_activations": first == "full_distributed"}  # fmt: skip
    if any(c != first for c in choices):
        return None
    if first == "none":
        return {"recompute_granularity": None}
    modules = first.partition(":")[2].split("+")
    if not set(modules) <= set(MEGATRON_RECOMPUTE_MODULES):
        return None
    return {"recompute_granularity": "selective", "recompute_modules": modules}


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MegatronCoreBlock:
    """megatron-core's TransformerBlock as the planner drives it: ``layers``, ``config``,
    :meth:`set_layer_recompute` (the choices :func:`megatron_fields` expresses, set in place)
    and ``probe`` (module hooks that set the planner's marks). :meth:`of` gives one view per
    block, which remembers the block's own settings for ``set_layer_recompute(None)``."""

    def __init__(self, block: torch.nn.Module) -> None:
        config = block.config
        if getattr(config, "fp8", None) or getattr(config, "fp4", None):
            raise MegatronCoreError(
                "recompute planner: megatron-core's block runs fp8/fp4 (Transformer Engine's "
                "checkpoint); the planner probes the local spec's recompute"
            )
        for index, layer in enumerate(block.layers):
            if getattr(layer, "is_moe_layer", False):
                raise MegatronCoreError(
                    f"recompute planner: megatron-core's layer {index} is a MoE layer; the "
                    "planner probes dense layers"
                )
            missing = [f for f in _LAYER_FLAGS if not hasattr(layer, f)]
            if missing or not hasattr(getattr(layer, "self_attention", None),
                                      "checkpoint_core_attention"):  # fmt: skip
                raise MegatronCoreError(
                    f"recompute planner: megatron-core's layer {index} ({type(layer).__name__}) "
                    f"lacks the recompute flags {missing or ['checkpoint_core_attention']}"
                )
        # weakly: the view is the value of a WeakKeyDictionary keyed by the block, and a strong
        # reference there would keep the block (and every model planned) alive for good
        self._block = weakref.ref(block)
        self.config = config
        self._own = self._settings()
        self._probe = None
        self._handles: list = []

    @property
    def block(self) -> torch.nn.Module:
        """megatron-core's TransformerBlock this view drives."""
        return self._block()

    @property
    def layers(self) -> torch.nn.ModuleList:
        """The block's layers."""
        return self.block.layers

    @classmethod
    def of(cls, block: torch.nn.Module) -> MegatronCoreBlock:
        """The one view of ``block``."""
        view = _VIEWS.get(block)
        if view is None:
            view = _VIEWS[block] = cls(block)
        return view

    def _settings(self) -> tuple:
        fields = {name: getattr(self.config, name, None) for name in _FIELDS}
        flags = [
            [getattr(layer, f) for f in _LAYER_FLAGS]
            + [layer.self_attention.checkpoint_core_attention]
            for layer in self.layers
        ]
        return fields, flags

    def set_layer_recompute(self, choices) -> None:
        """Set per-layer ``choices`` (:func:`megatron_fields` must express them) on the block:
        its config's recompute fields and its layers' flags, as megatron-core would have built
        them from those fields; ``None`` gives back the block's own settings. Raises
        MegatronCoreError (changing nothing) for choices megatron-core cannot express."""
        if choices is None:
            fields, flags = self._own
            self._put(fields, flags)
            return
        choices = list(choices)
        if len(choices) != len(self.layers):
            raise MegatronCoreError(
                f"recompute planner: {len(choices)} choices for megatron-core's block of "
                f"{len(self.layers)} layers"
            )
        fields = megatron_fields(choices)
        if fields is None:
            raise MegatronCoreError(
                f"recompute planner: megatron-core's TransformerConfig cannot express {choices} "
                "(one selective set or none on every layer, or full recompute of the first n "
                "layers: RecomputePlan.megatron holds the fastest plan it can)"
            )
        modules = fields.get("recompute_modules", ())
        flags = []
        for layer in self.layers:
            flags.append([
                "layernorm" in modules and type(layer.input_layernorm).__name__ != "IdentityOp",
                "layernorm" in modules and type(layer.pre_mlp_layernorm).__name__ != "IdentityOp",
                "mlp" in modules,
                "core_attn" in modules,
            ])  # fmt: skip
        full = dict.fromkeys(_FIELDS)
        full.update(fields)
        if full["recompute_granularity"] != "full":
            full.update({f: self._own[0][f] for f in _FIELDS[1:4]})
        if full["recompute_modules"] is None:
            full["recompute_modules"] = self._own[0]["recompute_modules"]
        self._put(full, flags)

    def _put(self, fields: dict, flags: list) -> None:
        for name, value in fields.items():
            setattr(self.config, name, value)
        for layer, values in zip(self.layers, flags):
            for name, value in zip(_LAYER_FLAGS, values[:3]):
                setattr(layer, name, value)
            layer.self_attention.checkpoint_core_attention = values[3]

    @property
    def probe(self):
        """The planner's marks (probe.LayerMarks) while a probe step runs, else None."""
        return self._probe

    @probe.setter
    def probe(self, marks) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._probe = [], marks
        if marks is not None:
            self._handles = _install_marks(self.block, marks)


def _install_marks(block: torch.nn.Module, marks) -> list:
    """Hooks that set ``marks``' layer marks on megatron-core's block. Each layer's hooks act on
    its first call in each microbatch of the probe step only: a full recompute runs the layers
    again in backward. Under full recompute a layer runs inside a checkpoint, without grad: the
    gradient mark of layer i's output then goes on the checkpoint's output, which the next
    layer (or the final norm, or the block's caller) receives as its input."""
    layers = list(block.layers)
    entered, left = set(), set()

    # A tensor that carries a gradient mark says so itself (an id could come back on a new
    # tensor once the first is freed: the checkpoints keep their inputs, not the Python objects).
    def marked(hidden) -> bool:
        return getattr(hidden, "_recompute_plan_marks", None) is marks

    def mark_gradient(index: int, hidden) -> None:
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad and not marked(hidden):
            hidden._recompute_plan_marks = marks
            marks.output_gradient(index, hidden)

    # one set of marks per microbatch of a probe step (LayerMarks.prefix names it)
    def before(index: int):
        def hook(module, args, kwargs):
            if (marks.prefix, index) in entered:
                return
            entered.add((marks.prefix, index))
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if index == 0:
                marks.layer_input(0, hidden)
            else:
                mark_gradient(index - 1, hidden)

        return hook

    def after(index: int):
        def hook(module, args, kwargs, output):
            if (marks.prefix, index) in left:
                return
            left.add((marks.prefix, index))
            hidden = output[0] if isinstance(output, tuple) else output
            marks.layer_output(index, hidden)
            if hidden.requires_grad:
                hidden._recompute_plan_marks = marks

        return hook

    def last_output(module, args, kwargs, output=None):
        hidden = output if output is not None else kwargs.get("input", args[0] if args else None)
        mark_gradient(len(layers) - 1, hidden[0] if isinstance(hidden, tuple) else hidden)

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(after(index), with_kwargs=True))
    norm = getattr(block, "final_layernorm", None)
    if norm is not None:
        handles.append(norm.register_forward_pre_hook(last_output, with_kwargs=True))
    else:
        handles.append(block.register_forward_hook(last_output, with_kwargs=True))
    return handles
