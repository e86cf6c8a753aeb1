"""DeepSpeed 0.19's activation-checkpointing API (``deepspeed.checkpointing``) on this package.

Porting: ``import deepspeed.checkpointing as ckpt`` becomes
``from megatron_core import deepspeed_checkpointing as ckpt``; ``ckpt.configure(mpu, ...)``,
``ckpt.checkpoint(fn, *args, **kwargs)`` and the RNG helpers keep DeepSpeed's names, arguments
and defaults. The machinery is tensor_parallel/recompute/ (RNG replay, 1-D chunks, backward
through the recomputed outputs; saved_inputs.py keeps and rebuilds each tensor). Files: this one
(the module globals, ``checkpoint``), config.py (the settings dataclass, the DeepSpeed config
section and the checks), saved_arguments.py (which arguments are partitioned or copied to the
CPU, the contiguous buffers).

# NOTE [ DeepSpeed checkpointing ]
1. Settings. ``configure`` writes the module globals ``PARTITION_ACTIVATIONS``,
   ``CONTIGUOUS_CHECKPOINTING``, ``num_layers``, ``CPU_CHECKPOINT``, ``SYNCHRONIZE``,
   ``PROFILE_TIME``, ``mpu`` and ``deepspeed_checkpointing_enabled``; every ``checkpoint`` call
   reads them when its forward starts (a test that assigns them directly is obeyed) and its
   backward uses what its forward read.
2. Partition. With ``PARTITION_ACTIVATIONS`` every floating-point tensor argument (any size,
   contiguous or not, requiring grad or not; not one whose ``no_checkpointing`` attribute is
   True) is kept as this rank's 1-D chunk of ceil(numel / tp) elements (the last chunk
   zero-padded), and all-gathered over mpu's tensor-parallel group before the recompute. Every
   rank of that group must run the backward. Other arguments are kept as given.
3. CPU. With ``CPU_CHECKPOINT`` the kept copies of those arguments (their chunks when
   partitioned) live on the CPU and are copied back to the argument's device for the recompute.
4. Contiguous buffers. With ``CONTIGUOUS_CHECKPOINTING`` (needs partitioning and ``num_layers``;
   the chunk of floating argument j is copied into one of ``num_layers`` buffers preallocated
   for (j, chunk size, dtype, device) on first use; both checkpoints, reentrant and not). A
   reentrant checkpoint's backward gives its buffers back, a non-reentrant one's graph when it
   is freed (a ``retain_graph`` backward may run again), so the next step reuses the same
   tensors: no allocation per step after the first.
   More checkpoints alive at once than ``num_layers`` raise MegatronCoreError (DeepSpeed fails
   with an IndexError). Forward passes without backward (eval with grad on) must call
   ``reset()``, which frees every buffer, as in DeepSpeed.
5. Synchronize and profile. ``SYNCHRONIZE`` waits for the device (megatron_core.device; a
   no-op on the CPU) before and after forward and backward; ``PROFILE_TIME`` prints
   ``time (ms) | fwd: x`` and ``time (ms) | backward: x`` on global rank 0, as DeepSpeed does.
6. RNG. The forward snapshots the CPU, device and tracker streams and the recompute replays
   them (NOTE [ Checkpoint rules ], rule 2): checkpointed and plain runs agree bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.deepspeed_checkpointing.config import (
    Settings,
    check_mpu,
    check_settings,
    read_config,
)
from megatron_core.deepspeed_checkpointing.saved_arguments import BUFFERS as _BUFFERS
from megatron_core.deepspeed_checkpointing.saved_arguments import SavedArguments
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
)
from megatron_core.tensor_parallel.random import (
    model_parallel_cuda_manual_seed as _megatron_manual_seed,
)
from megatron_core.tensor_parallel.recompute.nonreentrant import checkpoint_without_reentrant
from megatron_core.tensor_parallel.recompute.saved_inputs import (
    CheckpointOptions,
    ForwardState,
    backward_through,
    checkpointing_region,
)

__all__ = [
    "configure",
    "is_configured",
    "checkpoint",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "CudaRNGStatesTracker",
    "CheckpointFunction",
    "partition_activations_in_checkpoint",
    "detach_variable",
]

_LOG = logging.getLogger(__name__)

# DeepSpeed's module globals (NOTE [ DeepSpeed checkpointing ], rule 1).
deepspeed_checkpointing_enabled = False
mpu = None
num_layers = None
PARTITION_ACTIVATIONS = False
CONTIGUOUS_CHECKPOINTING = False
CPU_CHECKPOINT = False
SYNCHRONIZE = False
PROFILE_TIME = False


def configure(
    mpu_: Any,
    deepspeed_config: Mapping[str, Any] | str | os.PathLike | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the module's checkpointing settings (DeepSpeed's ``configure``; touches no tensor).

    Starts from DeepSpeed's defaults (all off, ``num_layers`` None), applies the
    "activation_checkpointing" section of ``deepspeed_config``, then every argument that is not
    None. Everything is validated before any global changes. Frees the contiguous buffers.

    Args:
        mpu_: the model-parallel unit (``megatron_core.parallel_state`` or any object with
            DeepSpeed's mpu getters); None keeps the current ``mpu``. Its tensor-parallel group
            is what partitions split over.
        deepspeed_config: a DeepSpeed config dict or the path of its JSON file.
        partition_activations: keep 1/tp of each floating argument per rank.
        contiguous_checkpointing: copy the partitions into preallocated buffers.
        num_checkpoints: how many checkpoints a step keeps (buffers per argument).
        checkpoint_in_cpu: keep the saved arguments on the CPU.
        synchronize: synchronize the device around forward and backward.
        profile: print forward and backward times on rank 0.

    Raises:
        MegatronCoreError: a bad value, an unknown config key, contiguous checkpointing without
            partitioning or num_checkpoints, or an mpu without the getters.
    """
    global mpu, num_layers, deepspeed_checkpointing_enabled, PARTITION_ACTIVATIONS
    global CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE, PROFILE_TIME
    settings = Settings()
    if deepspeed_config is not None:
        settings = dataclasses.replace(settings, **read_config(deepspeed_config))
    explicit = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    settings = dataclasses.replace(settings, **{k: v for k, v in explicit.items() if v is not None})
    check_settings(settings)
    if mpu_ is not None:
        check_mpu(mpu_)
        mpu = mpu_
    PARTITION_ACTIVATIONS = settings.partition_activations
    CONTIGUOUS_CHECKPOINTING = settings.contiguous_checkpointing
    num_layers = settings.num_checkpoints
    CPU_CHECKPOINT = settings.checkpoint_in_cpu
    SYNCHRONIZE = settings.synchronize
    PROFILE_TIME = settings.profile
    deepspeed_checkpointing_enabled = True
    _BUFFERS.free()


def is_configured() -> bool:
    """True once :func:`configure` has run (DeepSpeed's ``deepspeed_checkpointing_enabled``)."""
    return deepspeed_checkpointing_enabled


def set_num_layers(nlayers: int) -> None:
    """Set ``num_layers``, the number of contiguous buffers per argument (frees the buffers)."""
    global num_layers
    if type(nlayers) is not int or nlayers <= 0:
        raise MegatronCoreError(f"set_num_layers: nlayers ({nlayers!r}) must be a positive int")
    num_layers = nlayers
    _BUFFERS.free()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn partitioning of the saved arguments on or off (DeepSpeed's function of this name:
    sets ``PARTITION_ACTIVATIONS``, which later checkpoints read, and logs the value on global
    rank 0). Touches no tensor and no group."""
    global PARTITION_ACTIVATIONS
    if not isinstance(partition_activation, bool):
        raise MegatronCoreError(
            f"partition_activations_in_checkpoint: partition_activation ({partition_activation!r}) "
            "must be a bool"
        )
    PARTITION_ACTIVATIONS = partition_activation
    if not dist.is_initialized() or dist.get_rank() == 0:
        _LOG.info("partition activations in checkpoint: %s", partition_activation)


def detach_variable(inputs: tuple, device: torch.device | str | None = None) -> tuple:
    """DeepSpeed's ``detach_variable``: each tensor of the tuple ``inputs`` detached (moved to
    ``device`` first when given) with its ``requires_grad`` kept; other items as they are.

    Raises:
        MegatronCoreError: ``inputs`` is not a tuple (DeepSpeed raises RuntimeError).
    """
    if not isinstance(inputs, tuple):
        raise MegatronCoreError(
            f"detach_variable: inputs must be a tuple, got {type(inputs).__name__}"
        )
    out = []
    for item in inputs:
        if torch.is_tensor(item):
            moved = item if device is None else item.to(device=device)
            item = moved.detach().requires_grad_(item.requires_grad)
        out.append(item)
    return tuple(out)


def reset() -> None:
    """Free the contiguous buffers (DeepSpeed's ``reset``; call it after forwards without
    backward). Checkpoints still waiting for backward keep the buffers they hold."""
    _BUFFERS.free()


# --- the tensor-parallel group of mpu ------------------------------------------------------------


def _tp() -> tuple[int, int, dist.ProcessGroup | None]:
    """(size, rank, group) of the tensor-parallel group of ``mpu`` (1, 0, None without one)."""
    unit = mpu
    if unit is None:
        return 1, 0, None
    prefix = "get_tensor_model_parallel_"
    if not hasattr(unit, prefix + "rank"):
        prefix = "get_model_parallel_"
    size = getattr(unit, prefix + "world_size")()
    if size == 1:
        return 1, 0, None
    return size, getattr(unit, prefix + "rank")(), getattr(unit, prefix + "group")()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generators with ``seed`` and register "model-parallel-rng" =
    seed + 2718 + tp_rank (DeepSpeed's arithmetic), the tp rank read from ``mpu``.

    The tracker also gets megatron-core's "data-parallel-rng" and "expert-parallel-rng" streams
    (tensor_parallel.random.model_parallel_cuda_manual_seed does the work).
    """
    tp_rank = _tp()[1] if mpu is not None else None
    _megatron_manual_seed(seed, tp_rank=tp_rank)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the "model-parallel-rng" stream with seed + 2718 + tp_rank (DeepSpeed's)."""
    tp_rank = _tp()[1] if mpu is not None else parallel_state.get_tensor_model_parallel_rank()
    with get_cuda_rng_tracker().fork():
        device.manual_seed(seed + 2718 + tp_rank)


def _settings() -> Settings:
    """The module globals a checkpoint reads when its forward starts (rule 1), unchecked."""
    return Settings(
        partition_activations=bool(PARTITION_ACTIVATIONS),
        contiguous_checkpointing=bool(CONTIGUOUS_CHECKPOINTING),
        checkpoint_in_cpu=bool(CPU_CHECKPOINT),
        num_checkpoints=num_layers,
        synchronize=bool(SYNCHRONIZE),
        profile=bool(PROFILE_TIME),
    )


def _partition_tp(settings: Settings) -> tuple[int, int, dist.ProcessGroup | None]:
    """What partitions split over: mpu's TP group (size, rank, group), or one rank when off."""
    return _tp() if settings.partition_activations else (1, 0, None)


class _Timer:
    """Synchronize (rule 5) and time one forward or backward; print DeepSpeed's line."""

    def __init__(self, settings: Settings, name: str):
        self.settings, self.name = settings, name
        if settings.synchronize:
            device.synchronize()
        self.start = time.perf_counter()

    def stop(self) -> None:
        if self.settings.profile:
            if not self.settings.synchronize:
                device.synchronize()
            ms = (time.perf_counter() - self.start) * 1000.0
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"time (ms) | {self.name}: {ms:.2f}", flush=True)
        if self.settings.synchronize:
            device.synchronize()


class CheckpointFunction(torch.autograd.Function):
    """DeepSpeed's reentrant checkpoint: ``CheckpointFunction.apply(function, all_outputs,
    *args)``.

    Forward: snapshot the RNG streams, run ``function(*args)`` without grad, keep the arguments
    (rules 2-4), append the function's outputs (tensors and non-tensors) to ``all_outputs`` and
    return its tensors; integer tensors are marked non-differentiable. Backward: gather and move
    back the kept arguments, replay the RNG, recompute with grad, backpropagate the output
    gradients, return the arguments' gradients.
    """

    @staticmethod
    def forward(ctx, run_function, all_outputs, *args):
        """Run ``run_function(*args)`` without grad, keep its arguments, return its tensors."""
        settings = _settings()
        timer = _Timer(settings, "fwd")
        ctx.run_function, ctx.settings = run_function, settings
        ctx.state = ForwardState.capture()
        with torch.no_grad(), checkpointing_region():
            outputs = run_function(*args)
        ctx.saved = SavedArguments(args, settings, _partition_tp(settings))
        ctx.save_for_backward(*ctx.saved.tensors)
        ctx.saved.tensors = []
        timer.stop()
        if torch.is_tensor(outputs):
            all_outputs.append(outputs)
            tensors = (outputs,)
        else:
            all_outputs.extend(outputs)
            tensors = tuple(o for o in outputs if torch.is_tensor(o))
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return outputs if torch.is_tensor(outputs) else tensors

    @staticmethod
    def backward(ctx, *grads):
        """Recompute under the forward's RNG and return the arguments' gradients."""
        if not torch.autograd._is_checkpoint_valid():
            raise MegatronCoreError(
                "deepspeed_checkpointing.checkpoint does not support torch.autograd.grad: call "
                ".backward(), or use non_reentrant_checkpoint"
            )
        timer = _Timer(ctx.settings, "backward")
        inputs = ctx.saved.rebuild(ctx.saved_tensors)
        ctx.saved.release()
        with ctx.state.replayed(), torch.enable_grad(), checkpointing_region():
            outputs = ctx.run_function(*inputs)
        outputs = (outputs,) if torch.is_tensor(outputs) else outputs
        tensors = [o for o in outputs if torch.is_tensor(o)]
        result = backward_through(tensors, grads, inputs)
        timer.stop()
        return (None, None, *result)


def _with_kwargs(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """Pass keyword arguments positionally, so their tensors take part in autograd."""
    if not kwargs:
        return function, args
    keys, count = tuple(kwargs), len(args)

    def call(*all_args):
        return function(*all_args[:count], **dict(zip(keys, all_args[count:])))

    return call, args + tuple(kwargs.values())


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its arguments; recompute it in backward.

    DeepSpeed's ``checkpoint``: the arguments are kept as the module globals say (NOTE
    [ DeepSpeed checkpointing ]); tensor keyword arguments get gradients like positional ones.

    Returns:
        What ``function`` returns, its tensors attached to the graph; a tuple of one element
        comes back as that element, as in DeepSpeed.

    Raises:
        MegatronCoreError: contiguous checkpointing without ``num_layers`` or with more
            checkpoints waiting for backward than ``num_layers``; ``torch.autograd.grad``
            through it; no recomputed output requiring grad.
    """
    function, args = _with_kwargs(function, args, kwargs)
    if not torch.is_grad_enabled():  # no backward can follow: nothing to keep
        return function(*args)
    all_outputs: list[Any] = []
    result = CheckpointFunction.apply(function, all_outputs, *args)
    tensors = iter((result,) if torch.is_tensor(result) else result)
    merged = [next(tensors) if torch.is_tensor(o) else o for o in all_outputs]
    return merged[0] if len(merged) == 1 else tuple(merged)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``: the saved-tensor-hooks checkpoint.

    Works with ``torch.autograd.grad`` and with arguments that do not require grad. The
    arguments are kept as :func:`checkpoint` keeps them (rules 2-4: partitions, CPU copies,
    contiguous buffers); the buffers of a graph go back when the graph is freed, so a
    ``retain_graph`` backward may run again after other forwards. ``PROFILE_TIME`` prints the
    forward line and, per backward, a "backward" line timing the inputs' rebuild and the
    recompute (DeepSpeed's also spans the backpropagation after it).
    """
    settings = _settings()
    tp = _partition_tp(settings)
    options = CheckpointOptions(offload_to_cpu=settings.checkpoint_in_cpu, tp_group=tp[2])
    timer = _Timer(settings, "fwd")
    out = checkpoint_without_reentrant(
        function,
        options,
        args,
        {},
        context_fn=lambda: (contextlib.nullcontext(), _TimedRecompute(settings)),
        keep_inputs=lambda leaves: SavedArguments(leaves, settings, tp),
    )
    timer.stop()
    return out


class _TimedRecompute:
    """The recompute context of :func:`non_reentrant_checkpoint`: its "backward" line (rule 5)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def __enter__(self) -> None:
        self.timer = _Timer(self.settings, "backward")

    def __exit__(self, *exc) -> None:
        self.timer.stop()
