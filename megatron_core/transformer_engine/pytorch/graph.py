"""``transformer_engine.pytorch.graph``: CUDA graphs of Transformer Engine modules, refused.

megatron-core imports these names to capture Transformer Engine modules in CUDA graphs
(``cuda_graph_impl="transformer_engine"``, or its own "local" graphs of a model holding
Transformer Engine modules); every one of them raises, naming the feature.
"""

from __future__ import annotations

from typing import Any

from megatron_core.transformer_engine._refuse import not_provided

__all__ = [
    "make_graphed_callables",
    "set_capture_start",
    "set_capture_end",
    "save_fp8_tensors",
    "restore_fp8_tensors",
]

_INSTEAD = "Leave cuda_graph_impl at 'none' (--cuda-graph-impl none)"


def make_graphed_callables(*args: Any, **kwargs: Any):
    """Refused: CUDA graphs of Transformer Engine modules."""
    raise not_provided(
        "make_graphed_callables (CUDA graphs of Transformer Engine modules)", _INSTEAD
    )


def set_capture_start(*args: Any, **kwargs: Any):
    """Refused: a CUDA graph capture of Transformer Engine modules."""
    raise not_provided("a CUDA graph capture of Transformer Engine modules", _INSTEAD)


set_capture_end = set_capture_start


def save_fp8_tensors(*args: Any, **kwargs: Any):
    """Refused: FP8 state around CUDA graph captures."""
    raise not_provided("save_fp8_tensors (CUDA graphs with FP8)", _INSTEAD)


restore_fp8_tensors = save_fp8_tensors
