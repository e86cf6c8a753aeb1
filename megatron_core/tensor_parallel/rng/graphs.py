"""Graph-safe generator states: megatron-core's CUDA-graph RNG helpers (re-exported by random.py).

A generator state comes in two forms: a ByteTensor (``Generator.get_state()``), which any device
has, and a graph-safe ``torch.Generator`` (``Generator.graphsafe_get_state()``), which CUDA graphs
can capture draws from and which needs an accelerator. A tracker built with
``use_cudagraphable_rng=True`` keeps its streams in the second form.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core import compat, device
from megatron_core.errors import MegatronCoreError

__all__ = ["convert_cuda_rng_state", "is_graph_safe_cuda_rng_tracker"]


def convert_cuda_rng_state(
    state: torch.Tensor | torch.Generator, to_graphable: bool = False
) -> torch.Tensor | torch.Generator:
    """The same generator state in the other form (megatron-core's name and signature).

    Args:
        state: a ByteTensor state or a graph-safe generator state of the device generator.
        to_graphable: convert to a graph-safe ``torch.Generator`` (a state already in that form
            is returned as is); False converts to a ByteTensor (a tensor is returned as is).

    Returns:
        The state in the requested form; the device generator is left as it was.

    Raises:
        MegatronCoreError: ``state`` is neither form, or a graph-safe state is asked for on a
            device or torch without graph-safe generators (the CPU under gloo).
    """
    if not isinstance(state, torch.Tensor | torch.Generator):
        raise MegatronCoreError(
            f"convert_cuda_rng_state: state ({type(state).__name__}) must be a torch.Tensor or "
            "a torch.Generator"
        )
    if not to_graphable:
        return state.get_state() if isinstance(state, torch.Generator) else state
    if isinstance(state, torch.Generator):
        return state
    if not (device.is_accelerator() and compat.graph_safe_generators()):
        raise MegatronCoreError(
            f"convert_cuda_rng_state(to_graphable=True) needs an accelerator with graph-safe "
            f"generators; device type is {device.device_type()!r}"
        )
    graphable = device.device_generator().graphsafe_get_state().clone_state()
    graphable.set_state(state)
    return graphable


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker: Any) -> bool:
    """True if ``cuda_rng_tracker`` keeps graph-safe states (``use_cudagraphable_rng``) or is
    Transformer Engine's tracker (always graph-safe in megatron-core's sense)."""
    if getattr(cuda_rng_tracker, "use_cudagraphable_rng", False):
        return True
    mro = type(cuda_rng_tracker).__mro__
    return any(
        c.__name__ == "TECudaRNGStatesTracker" or c.__module__.startswith("transformer_engine")
        for c in mro
    )
