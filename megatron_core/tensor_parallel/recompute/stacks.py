"""Checkpointing a stack of layers: megatron-core's full-recompute methods and torch's
``checkpoint_sequential``. Both call entry_points.py's :func:`checkpoint` per region; every rule
of NOTE [ Checkpoint rules ] in entry_points.py applies to each region.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.recompute.entry_points import checkpoint

__all__ = ["RecomputeMethod", "checkpoint_layer_stack", "checkpoint_sequential"]


class RecomputeMethod(str, enum.Enum):
    """megatron-core's ``recompute_method`` for full recompute of a layer stack."""

    UNIFORM = "uniform"  # chunks of recompute_num_layers layers, each one checkpoint
    BLOCK = "block"  # the first recompute_num_layers layers, one checkpoint each


def checkpoint_layer_stack(
    layers: Sequence[Callable[..., torch.Tensor]],
    hidden_states: torch.Tensor,
    *args: Any,
    recompute_method: RecomputeMethod | str,
    recompute_num_layers: int,
    distribute_saved_activations: bool = False,
    **checkpoint_kwargs: Any,
) -> torch.Tensor:
    """Run ``layers`` in order with megatron-core's full-recompute settings.

    Each layer is called as ``layer(hidden_states, *args)`` and returns the new hidden states;
    ``args`` (e.g. an attention mask) go to every layer and are inputs of every checkpoint.
    This is megatron-core's ``TransformerBlock._checkpointed_forward``.

    Args:
        layers: the stack, e.g. an ``nn.ModuleList``.
        hidden_states: input of the first layer.
        *args: extra inputs of every layer.
        recompute_method: "uniform": layers [0, n), [n, 2n), ... each checkpointed as one region
            (the last may be shorter); "block": layers 0 .. n-1 checkpointed one by one, the rest
            run without checkpointing (n = recompute_num_layers).
        recompute_num_layers: n above; >= 1 for "uniform", >= 0 for "block".
        distribute_saved_activations: as in :func:`checkpoint` (splits the hidden states).
        **checkpoint_kwargs: keyword settings of :func:`checkpoint` (use_reentrant, ...).

    Raises:
        MegatronCoreError: an unknown method or a bad recompute_num_layers.
    """
    try:
        method = RecomputeMethod(recompute_method)
    except ValueError:
        raise MegatronCoreError(
            f"checkpoint_layer_stack: recompute_method ({recompute_method!r}) must be one of "
            f"{[m.value for m in RecomputeMethod]}"
        ) from None
    least = 1 if method is RecomputeMethod.UNIFORM else 0
    if (
        isinstance(recompute_num_layers, bool)
        or not isinstance(recompute_num_layers, int)
        or (recompute_num_layers < least)
    ):
        raise MegatronCoreError(
            f"checkpoint_layer_stack: recompute_num_layers ({recompute_num_layers!r}) must be an "
            f"integer >= {least} for recompute_method {method.value!r}"
        )
    layers = list(layers)
    if method is RecomputeMethod.UNIFORM:
        size = recompute_num_layers
        regions = [(start, start + size, True) for start in range(0, len(layers), size)]
    else:
        regions = [(i, i + 1, i < recompute_num_layers) for i in range(len(layers))]
    for start, end, recompute in regions:
        run = _run_layers(layers[start:end])
        if recompute:
            hidden_states = checkpoint(
                run, distribute_saved_activations, hidden_states, *args, **checkpoint_kwargs
            )
        else:
            hidden_states = run(hidden_states, *args)
    return hidden_states


def _run_layers(layers: list[Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
    def run(hidden_states: torch.Tensor, *args: Any) -> torch.Tensor:
        for layer in layers:
            hidden_states = layer(hidden_states, *args)
        return hidden_states

    return run


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    distribute_saved_activations: bool | None = False,
    **checkpoint_kwargs: Any,
) -> Any:
    """Run ``functions`` in order, each of the first ``segments - 1`` segments one checkpoint.

    torch.utils.checkpoint.checkpoint_sequential's semantics: the functions (a Sequential's
    children, or a list) are cut into ``segments`` parts of ``len(functions) // segments``
    functions, the last part taking the remainder; every part but the last is checkpointed, the
    last runs plainly (its output is needed right away). Each function takes the previous one's
    output. Our options apply to every checkpointed part.

    Args:
        functions: the layers; ``input`` of shape [..] goes through ``functions[0]`` first.
        segments: number of parts, 1 <= segments <= len(functions).
        input: input of the first function (a tensor; with distribute_saved_activations each
            part's input is kept as this rank's 1-D chunk).
        use_reentrant: as in :func:`checkpoint`; None warns (as torch does) and means True.
        distribute_saved_activations: as in :func:`checkpoint` (rule 3).
        **checkpoint_kwargs: further settings of :func:`checkpoint` (offload_to_cpu, distribute,
            check_determinism, tp_group, and for use_reentrant=False context_fn, debug,
            early_stop).

    Returns:
        The last function's output.

    Raises:
        MegatronCoreError: ``segments`` out of range (before anything runs), or any error of
            :func:`checkpoint`.
    """
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise MegatronCoreError(f"checkpoint_sequential: segments ({segments!r}) must be an int")
    if not 1 <= segments <= len(functions):
        raise MegatronCoreError(
            f"checkpoint_sequential: segments ({segments}) must be between 1 and the number of "
            f"functions ({len(functions)})"
        )
    if use_reentrant is None:
        warnings.warn(
            "checkpoint_sequential: pass use_reentrant explicitly (as torch asks); "
            "use_reentrant=False is recommended, None means True",
            stacklevel=2,
        )
        use_reentrant = True
    size = len(functions) // segments
    end = 0
    for start in range(0, size * (segments - 1), size):
        end = start + size
        input = checkpoint(
            _run_layers(functions[start:end]),
            distribute_saved_activations,
            input,
            use_reentrant=use_reentrant,
            **checkpoint_kwargs,
        )
    return _run_layers(functions[end:])(input)
