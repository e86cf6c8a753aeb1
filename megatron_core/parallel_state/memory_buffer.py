"""GlobalMemoryBuffer: the scratch buffers parallel_state hands out (``get_global_memory_buffer``).

megatron-core defines it in ``megatron.core.utils``; ``megatron_core.utils`` re-exports it from
here, so parallel_state does not import utils (which reads parallel_state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from megatron_core import device

__all__ = ["GlobalMemoryBuffer"]


class GlobalMemoryBuffer:
    """Reusable scratch tensors, one flat buffer per ``(name, dtype)``, to avoid re-allocation.

    ``get_tensor(shape, dtype, name)`` returns a view of shape ``shape`` over the first
    ``prod(shape)`` elements of the buffer for ``(name, dtype)``, growing it (a fresh, uninitialized
    allocation on the current device) when it is too small. Two calls with the same name and dtype
    return views of the same memory, so a caller must be done with one before asking again.

    Attributes:
        buffer: ``(name, dtype)`` -> the flat tensor behind the views.
    """

    def __init__(self):
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape,
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable | None = None,
    ) -> torch.Tensor:
        """A ``tensor_shape`` view of the ``(name, dtype)`` buffer (contents are not cleared).

        Args:
            tensor_shape: the shape wanted.
            dtype: element type; each dtype has its own buffer.
            name: buffer name (megatron-core uses "mpu" for sequence-parallel all-gathers).
            mem_alloc_context: context manager entered around a (re)allocation, if given.
        """
        numel = math.prod(tensor_shape)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < numel:
            with (mem_alloc_context or nullcontext)():
                current = torch.empty(
                    numel, dtype=dtype, device=device.current_device(), requires_grad=False
                )
            self.buffer[(name, dtype)] = current
        return current[:numel].view(*tensor_shape)
