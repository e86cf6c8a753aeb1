"""Autocast-aware autograd functions: backward runs under the autocast state forward ran under.

``torch.autograd.Function.backward`` runs outside any ``torch.autocast`` region (the engine runs
it after the ``with`` block is gone). An autograd function whose forward was autocast, say to
bf16, then meets a bf16 output gradient and its own fp32 saved weight in backward, and
``grad_output.matmul(weight)`` fails with "expected m1 and m2 to have the same dtype".
megatron-core decorates its linear function with torch's ``custom_fwd`` / ``custom_bwd`` for this,
fixed to ``device_type="cuda"``. Here the device type comes from the tensors, so the same
function is correct under ``torch.autocast("cpu", ...)`` and ``torch.autocast("cuda", ...)``.

NOTE [ Autocast in autograd functions ]
1. :func:`custom_fwd` wraps ``forward(ctx, *args)``: it finds the device type of the first tensor
   argument ("cpu" when there is none), records it on ``ctx``, and runs forward through
   ``torch.amp.custom_fwd(device_type=...)``, which records whether autocast was enabled for
   that device type and its dtype. Forward itself runs in the caller's autocast state, so its
   matmuls are cast exactly as ``torch.nn.functional.linear``'s would be.
2. :func:`custom_bwd` wraps ``backward(ctx, *grads)`` with ``torch.amp.custom_bwd`` for the
   recorded device type: backward runs inside ``torch.autocast(device_type, enabled=<as in
   forward>, dtype=<as in forward>)``. Its matmuls see the same casts as forward's, so the
   gradients have the dtype autograd would give ``nn.Linear`` under the same autocast
   (the engine then casts each gradient to its input's dtype).
3. Inside a checkpoint's recompute, forward runs under the autocast state the checkpoint
   replays (NOTE [ Checkpoint rules ], rule 2), so rule 1 records that state, not the state of
   the backward pass that triggered the recompute.
4. Functions that only communicate (the region functions of mappings.py) preserve dtypes and
   need no decoration; vocab_parallel_cross_entropy computes in fp32 whatever the autocast state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["custom_fwd", "custom_bwd", "autocast_device_type"]

_CTX_DEVICE_TYPE = "_megatron_core_autocast_device_type"


def autocast_device_type(*args) -> str:
    """The device type ("cpu", "cuda", ...) of the first tensor in ``args``; "cpu" if none.

    Args:
        *args: any values; only ``torch.Tensor`` instances are looked at.

    Returns:
        The ``device.type`` string torch.autocast takes for that tensor.
    """
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def custom_fwd(forward: Callable) -> Callable:
    """Decorate an autograd Function's ``forward`` to record the autocast state (NOTE rule 1).

    Args:
        forward: ``forward(ctx, *args, **kwargs)`` (a staticmethod's function).

    Returns:
        The wrapped forward; tensors and results are passed through unchanged.
    """

    @functools.wraps(forward)
    def wrapped(ctx, *args, **kwargs):
        kind = autocast_device_type(*args, *kwargs.values())
        setattr(ctx, _CTX_DEVICE_TYPE, kind)
        return torch.amp.custom_fwd(forward, device_type=kind)(ctx, *args, **kwargs)

    return wrapped


def custom_bwd(backward: Callable) -> Callable:
    """Decorate an autograd Function's ``backward`` to run under forward's autocast state (rule 2).

    Args:
        backward: ``backward(ctx, *grad_outputs)`` of a Function whose forward is decorated with
            :func:`custom_fwd`.

    Returns:
        The wrapped backward; the gradients it returns are those of ``backward``.
    """

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        kind = getattr(ctx, _CTX_DEVICE_TYPE, None)
        if kind is None:  # forward was not decorated: nothing recorded, run as is
            return backward(ctx, *grads)
        return torch.amp.custom_bwd(backward, device_type=kind)(ctx, *grads)

    return wrapped
