"""Op logs of a checkpointed region for ``checkpoint(..., debug=True)``.

With ``debug=True`` the non-reentrant checkpoint records every aten op of the forward and of
each recompute (name, output shapes and dtypes) with a ``TorchDispatchMode``. When the recompute
differs from the forward (NOTE [ Non-reentrant recompute ], rule 4 in
nonreentrant.py), the error shows the first op where the two logs part, with a few
ops of context from each side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["OpLog", "first_difference"]

_CONTEXT = 3  # ops shown before the first difference


def _describe(out: Any) -> str:
    parts = [
        f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor)
    ]
    return ", ".join(parts) if parts else "no tensor"


class OpLog(TorchDispatchMode):
    """Records ``"aten.op -> dtype[shape], ..."`` for every op run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.muted = False  # set by the checkpoint's own hooks: their ops are not the region's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.muted:
            self.ops.append(f"{func} -> {_describe(out)}")
        return out

    @contextlib.contextmanager
    def mute(self) -> Iterator[None]:
        """Ops run inside the block are not recorded."""
        muted, self.muted = self.muted, True
        try:
            yield
        finally:
            self.muted = muted


def first_difference(forward: OpLog, recompute: OpLog) -> str:
    """Where the recompute's ops part from the forward's, as lines for an error message."""
    a, b = forward.ops, recompute.ops
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if n == len(a) == len(b):
        return f"debug: the {n} ops of forward and recompute are the same; the saved tensors differ"
    start = max(0, n - _CONTEXT)

    def side(ops: list[str]) -> str:
        shown = [f"    #{i} {op}" for i, op in enumerate(ops[start : n + 1], start)]
        if n >= len(ops):
            shown.append(f"    #{n} (no op: the run ended after {len(ops)} ops)")
        return "\n".join(shown)

    return (
        f"debug: first differing op is #{n} (forward ran {len(a)} ops, recompute {len(b)} "
        f"before it stopped)\n  forward:\n{side(a)}\n  recompute:\n{side(b)}"
    )
