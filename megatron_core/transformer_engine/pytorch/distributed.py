"""``transformer_engine.pytorch.distributed``: the RNG tracker and activation checkpointing.

Both are this package's own (``tensor_parallel.random``'s tracker, ``tensor_parallel``'s
checkpoint) under Transformer Engine's names and signatures, so a model that mixes
megatron-core's and Transformer Engine's calls has one set of RNG streams and one recompute
(NOTE [ RNG streams ], NOTE [ Checkpoint rules ]).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import random as tp_random
from megatron_core.tensor_parallel.recompute.entry_points import checkpoint as tp_checkpoint
from megatron_core.transformer_engine._refuse import not_provided

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_all_rng_states",
    "set_all_rng_states",
    "activation_recompute_forward",
    "is_fp8_activation_recompute_enabled",
    "in_fp8_activation_recompute_phase",
    "use_reentrant_activation_recompute",
    "get_distributed_world_size",
    "get_distributed_rank",
]

_ALL_ACTIVE_RNG_STATES: dict[str, Any] = {}


def get_all_rng_states() -> dict[str, Any]:
    """The streams of the last :class:`CudaRNGStatesTracker` that added one (name -> state)."""
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states: dict[str, Any]) -> None:
    """Make ``states`` what :func:`get_all_rng_states` returns."""
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


class CudaRNGStatesTracker(tp_random.CudaRNGStatesTracker):
    """Transformer Engine's RNG tracker: named device-generator streams and ``fork(name)``.

    It is this package's tracker (NOTE [ RNG streams ]), constructed without arguments as
    Transformer Engine's is; :meth:`add` also publishes the streams to
    :func:`~megatron_core.transformer_engine.pytorch.distributed.get_all_rng_states`.
    """

    def __init__(self) -> None:
        super().__init__()

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` seeded with ``seed`` (see the base class)."""
        super().add(name, seed)
        set_all_rng_states(self.states_)


def get_distributed_world_size(group: dist.ProcessGroup | None = None) -> int:
    """The size of ``group`` (the world when None); 1 without torch.distributed."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def get_distributed_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the world when None)."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


class activation_recompute_forward(contextlib.AbstractContextManager, contextlib.ContextDecorator):
    """Transformer Engine marks the forward and recompute phases of a checkpoint with this, for
    FP8 metadata; without FP8 there is nothing to mark, and it does nothing."""

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        self.activation_recompute = activation_recompute
        self.recompute_phase = recompute_phase

    def __exit__(self, *exc_details) -> None:
        return None


def is_fp8_activation_recompute_enabled() -> bool:
    """False: no FP8 activations to recompute."""
    return False


def in_fp8_activation_recompute_phase() -> bool:
    """False."""
    return False


_USE_REENTRANT = True


def use_reentrant_activation_recompute() -> bool:
    """Whether the last :func:`checkpoint` call asked for the reentrant mode."""
    return _USE_REENTRANT


def _legacy_positional(args: tuple) -> bool:
    """Transformer Engine < 1.5's form: checkpoint(fn, distribute, get_tracker, tp_group, *args)."""
    return (
        len(args) > 3
        and isinstance(args[0], bool)
        and callable(args[1])
        and (args[2] is None or isinstance(args[2], dist.ProcessGroup))
    )


def _check_tracker(get_rng_state_tracker: Callable | None) -> None:
    """The recompute replays this package's tracker (NOTE [ Checkpoint rules ], rule 2); a
    function that returns another tracker would not be replayed."""
    if get_rng_state_tracker is None:
        return
    tracker = get_rng_state_tracker()
    if tracker is not tp_random.get_cuda_rng_tracker():
        raise MegatronCoreError(
            f"checkpoint(get_rng_state_tracker={get_rng_state_tracker!r}): it returns "
            f"{type(tracker).__name__} at {id(tracker):#x}, not the tracker the recompute "
            "replays (megatron's get_cuda_rng_tracker()); pass get_cuda_rng_tracker or None"
        )


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute it in backward.

    Transformer Engine's signature: its own options are keywords (``distribute_saved_activations``
    default False, ``get_rng_state_tracker``, ``tp_group``, ``use_reentrant`` default True,
    ``context_fn``; ``determinism_check`` and ``debug`` are accepted and ignored), the rest go to
    ``function``; the positional form of releases before 1.5 is accepted too. It runs this
    package's ``tensor_parallel.checkpoint`` (NOTE [ Checkpoint rules ]): the reentrant mode
    with ``distribute_saved_activations`` splits the first input over ``tp_group`` (the world
    when None, as Transformer Engine does); the non-reentrant mode ignores that option.

    Raises:
        MegatronCoreError: ``get_rng_state_tracker`` returns another tracker than the one the
            recompute replays, or ``context_fn`` is given with the reentrant mode.
    """
    global _USE_REENTRANT
    use_reentrant = kwargs.pop("use_reentrant", True)
    distribute = kwargs.pop("distribute_saved_activations", False)
    tp_group = kwargs.pop("tp_group", None)
    get_rng_state_tracker = kwargs.pop("get_rng_state_tracker", None)
    context_fn = kwargs.pop("context_fn", None)
    kwargs.pop("determinism_check", None)
    kwargs.pop("debug", None)
    if _legacy_positional(args):
        distribute, get_rng_state_tracker, tp_group, args = args[0], args[1], args[2], args[3:]
    _check_tracker(get_rng_state_tracker)
    _USE_REENTRANT = bool(use_reentrant)
    if not use_reentrant:
        extra = {} if context_fn is None else {"context_fn": context_fn}
        return tp_checkpoint(function, False, *args, use_reentrant=False, **extra, **kwargs)
    if context_fn is not None:
        raise not_provided(
            "checkpoint(context_fn=..., use_reentrant=True)",
            "Pass use_reentrant=False to use a context_fn",
        )
    if distribute and tp_group is None:
        tp_group = dist.group.WORLD
    run = functools.partial(function, **kwargs) if kwargs else function
    return tp_checkpoint(run, bool(distribute), *args, tp_group=tp_group)
