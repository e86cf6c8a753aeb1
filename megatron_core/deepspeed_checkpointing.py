"""DeepSpeed 0.19's activation-checkpointing API (``deepspeed.checkpointing``) on this package.

Porting: ``import deepspeed.checkpointing as ckpt`` becomes
``from megatron_core import deepspeed_checkpointing as ckpt``; ``ckpt.configure(mpu, ...)``,
``ckpt.checkpoint(fn, *args, **kwargs)`` and the RNG helpers keep DeepSpeed's names, arguments
and defaults. The machinery is tensor_parallel/recompute/ (RNG replay, 1-D chunks, backward
through the recomputed outputs); this file adds DeepSpeed's settings, its contiguous buffers and
its profile lines.

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
4. Contiguous buffers. With ``CONTIGUOUS_CHECKPOINTING`` (needs partitioning and ``num_layers``)
   the chunk of floating argument j is copied into one of ``num_layers`` buffers preallocated
   for (j, chunk size, dtype, device) on first use. A checkpoint's backward gives its buffers
   back, so the next step reuses the same tensors: no allocation per step after the first.
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

import json
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
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
    Distribute,
    ForwardState,
    backward_through,
    checkpointing_region,
)
from megatron_core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
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
]

# DeepSpeed's module globals (NOTE [ DeepSpeed checkpointing ], rule 1).
deepspeed_checkpointing_enabled = False
mpu = None
num_layers = None
PARTITION_ACTIVATIONS = False
CONTIGUOUS_CHECKPOINTING = False
CPU_CHECKPOINT = False
SYNCHRONIZE = False
PROFILE_TIME = False

# The "activation_checkpointing" section of a DeepSpeed config: key -> (argument, default).
CONFIG_SECTION = "activation_checkpointing"
CONFIG_KEYS = {
    "partition_activations": ("partition_activations", False),
    "contiguous_memory_optimization": ("contiguous_checkpointing", False),
    "cpu_checkpointing": ("checkpoint_in_cpu", False),
    "number_checkpoints": ("num_checkpoints", None),
    "synchronize_checkpoint_boundary": ("synchronize", False),
    "profile": ("profile", False),
}


# --- configuration -----------------------------------------------------------------------------


def _read_config(deepspeed_config: Any) -> dict[str, Any]:
    """The configure() arguments a DeepSpeed config (dict or JSON path) sets, with defaults."""
    if isinstance(deepspeed_config, (str, os.PathLike)):
        try:
            with open(deepspeed_config) as f:
                deepspeed_config = json.load(f)
        except (OSError, ValueError) as e:
            raise MegatronCoreError(
                f"configure: cannot read the DeepSpeed config {str(deepspeed_config)!r}: {e}"
            ) from None
    if not isinstance(deepspeed_config, Mapping):
        raise MegatronCoreError(
            f"configure: deepspeed_config ({type(deepspeed_config).__name__}) must be a dict or "
            "the path of a JSON file"
        )
    section = deepspeed_config.get(CONFIG_SECTION, {})
    if not isinstance(section, Mapping):
        raise MegatronCoreError(
            f"configure: deepspeed_config[{CONFIG_SECTION!r}] ({section!r}) must be a dict"
        )
    unknown = sorted(set(section) - set(CONFIG_KEYS))
    if unknown:
        raise MegatronCoreError(
            f"configure: unknown key(s) {unknown} in deepspeed_config[{CONFIG_SECTION!r}]; "
            f"DeepSpeed's keys are {sorted(CONFIG_KEYS)}"
        )
    return {arg: section.get(key, default) for key, (arg, default) in CONFIG_KEYS.items()}


def _check_settings(settings: dict[str, Any]) -> None:
    """Raise MegatronCoreError naming the first bad value of configure()'s settings."""
    for name, value in settings.items():
        if name == "num_checkpoints":
            ok = value is None or (type(value) is int and value > 0)
            if not ok:
                raise MegatronCoreError(
                    f"configure: num_checkpoints ({value!r}) must be a positive int or None"
                )
        elif not isinstance(value, bool):
            raise MegatronCoreError(f"configure: {name} ({value!r}) must be a bool")
    if settings["contiguous_checkpointing"] and not settings["partition_activations"]:
        raise MegatronCoreError(
            "configure: contiguous_checkpointing=True needs partition_activations=True (the "
            "buffers hold partitions), as in DeepSpeed"
        )
    if settings["contiguous_checkpointing"] and settings["num_checkpoints"] is None:
        raise MegatronCoreError(
            "configure: contiguous_checkpointing=True needs num_checkpoints (the number of "
            "buffers per argument), got None"
        )


def _check_mpu(mpu_: Any) -> None:
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if all(hasattr(mpu_, prefix + s) for s in ("rank", "world_size", "group")):
            return
    raise MegatronCoreError(
        f"configure: mpu_ ({type(mpu_).__name__}) has neither get_tensor_model_parallel_rank/"
        "world_size/group nor get_model_parallel_rank/world_size/group (megatron_core."
        "parallel_state has both)"
    )


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
    settings = {arg: default for arg, default in CONFIG_KEYS.values()}
    if deepspeed_config is not None:
        settings.update(_read_config(deepspeed_config))
    explicit = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    settings.update({k: v for k, v in explicit.items() if v is not None})
    _check_settings(settings)
    if mpu_ is not None:
        _check_mpu(mpu_)
        mpu = mpu_
    PARTITION_ACTIVATIONS = settings["partition_activations"]
    CONTIGUOUS_CHECKPOINTING = settings["contiguous_checkpointing"]
    num_layers = settings["num_checkpoints"]
    CPU_CHECKPOINT = settings["checkpoint_in_cpu"]
    SYNCHRONIZE = settings["synchronize"]
    PROFILE_TIME = settings["profile"]
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


# --- contiguous buffers (rule 4) ---------------------------------------------------------------


class _Buffers:
    """num_layers preallocated chunk buffers per (argument position, numel, dtype, device)."""

    def __init__(self):
        self.generation = 0
        self.slots: dict[tuple, list[torch.Tensor]] = {}
        self.free_slots: dict[tuple, list[int]] = {}

    def free(self) -> None:
        self.generation += 1
        self.slots, self.free_slots = {}, {}

    def take(self, key: tuple, count: int | None) -> tuple[torch.Tensor, Callable[[], None]]:
        """A free buffer for ``key`` and the function that gives it back."""
        if count is None:
            raise MegatronCoreError(
                "checkpoint: CONTIGUOUS_CHECKPOINTING is on but num_layers is None: pass "
                "num_checkpoints to configure() or call set_num_layers()"
            )
        if key not in self.slots:
            _, numel, dtype, where = key
            self.slots[key] = [torch.empty(numel, dtype=dtype, device=where) for _ in range(count)]
            self.free_slots[key] = list(range(count - 1, -1, -1))
        if not self.free_slots[key]:
            raise MegatronCoreError(
                f"checkpoint: more than num_checkpoints ({len(self.slots[key])}) checkpoints "
                "are waiting for backward with contiguous_checkpointing; raise num_checkpoints, "
                "or call reset() after forward passes that have no backward"
            )
        index = self.free_slots[key].pop()
        given = [False]
        generation = self.generation

        def give_back() -> None:  # idempotent: backward and the finalizer both call it
            if not given[0] and self.generation == generation:
                self.free_slots[key].append(index)
            given[0] = True

        return self.slots[key][index], give_back


_BUFFERS = _Buffers()


# --- saved arguments (rules 2-4) -----------------------------------------------------------------


def _to_partition(x: torch.Tensor) -> bool:
    """Is ``x`` an activation DeepSpeed partitions/offloads (floating, not opted out)?"""
    return x.is_floating_point() and getattr(x, "no_checkpointing", False) is not True


class _Saved:
    """The arguments of one checkpoint as kept until its backward (rules 2-4)."""

    def __init__(self, args: Sequence[Any], settings: dict[str, Any]):
        self.leaves = [None if torch.is_tensor(x) else x for x in args]
        self.slots: list[tuple[int, torch.Size, tuple, torch.device, bool, bool]] = []
        self.tensors: list[torch.Tensor] = []
        self.give_back: list[Callable[[], None]] = []
        self.tp = _tp() if settings["partition"] else (1, 0, None)
        floating = 0
        for index, x in enumerate(args):
            if not torch.is_tensor(x):
                continue
            chosen = _to_partition(x)
            split = chosen and settings["partition"]
            if split:
                kept = self._partition(x.detach(), floating, settings)
                floating += 1
            elif chosen and settings["cpu"]:
                kept = x.detach().to("cpu", copy=True)
            else:
                kept = x
            self.tensors.append(kept)
            self.slots.append((index, x.shape, x.stride(), x.device, x.requires_grad, split))
        # A graph dropped without backward gives its buffers back too.
        weakref.finalize(self, _give_back_all, list(self.give_back))

    def _partition(self, x: torch.Tensor, position: int, settings: dict[str, Any]):
        size, _, group = self.tp
        if size == 1:
            chunk = x.reshape(-1).clone()
        else:
            chunk = split_tensor_into_1d_equal_chunks(x, new_buffer=True, tp_group=group)
        where = torch.device("cpu") if settings["cpu"] else chunk.device
        if settings["contiguous"]:
            key = (position, chunk.numel(), chunk.dtype, where)
            buffer, give_back = _BUFFERS.take(key, settings["num_layers"])
            self.give_back.append(give_back)
            return buffer.copy_(chunk)
        return chunk.to(where)

    def rebuild(self, kept: Sequence[torch.Tensor]) -> list[Any]:
        """The arguments again (gathered, on their devices), detached, with their requires_grad."""
        leaves = list(self.leaves)
        size, _, group = self.tp
        for (index, shape, stride, where, requires_grad, split), t in zip(self.slots, kept):
            t = t.to(where)
            if split:
                if size > 1:
                    t = gather_split_1d_tensor(t, numel=shape.numel(), tp_group=group)
                t = _with_strides(t.view(shape), stride)
            leaves[index] = t.detach().requires_grad_(requires_grad)
        return leaves

    def release(self) -> None:
        _give_back_all(self.give_back)


def _with_strides(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``t`` laid out with the argument's strides: a kernel may round differently for another
    layout (a bf16 matmul does), and the recompute must repeat the forward bitwise (rule 6).
    Expanded (stride 0) layouts stay contiguous."""
    if t.stride() == stride or 0 in stride:
        return t
    try:
        return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
    except RuntimeError:  # an overlapping layout: the values are what matters
        return t


def _give_back_all(give_backs: Sequence[Callable[[], None]]) -> None:
    for give_back in give_backs:
        give_back()


def _settings() -> dict[str, Any]:
    """The module globals a checkpoint reads when its forward starts (rule 1)."""
    return {
        "partition": bool(PARTITION_ACTIVATIONS),
        "cpu": bool(CPU_CHECKPOINT),
        "contiguous": bool(CONTIGUOUS_CHECKPOINTING),
        "num_layers": num_layers,
        "synchronize": bool(SYNCHRONIZE),
        "profile": bool(PROFILE_TIME),
    }


class _Timer:
    """Synchronize (rule 5) and time one forward or backward; print DeepSpeed's line."""

    def __init__(self, settings: dict[str, Any], name: str):
        self.settings, self.name = settings, name
        if settings["synchronize"]:
            device.synchronize()
        self.start = time.perf_counter()

    def stop(self) -> None:
        if self.settings["profile"]:
            if self.settings["synchronize"] is False:
                device.synchronize()
            ms = (time.perf_counter() - self.start) * 1000.0
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"time (ms) | {self.name}: {ms:.2f}", flush=True)
        if self.settings["synchronize"]:
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
        ctx.saved = _Saved(args, settings)
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

    Works with ``torch.autograd.grad`` and with arguments that do not require grad. With
    ``PARTITION_ACTIVATIONS`` every floating argument is kept as this rank's 1-D chunk, with
    ``CPU_CHECKPOINT`` on the CPU (the package's non-reentrant checkpoint, NOTE [ Checkpoint
    rules ], rules 3-5); contiguous buffers are not used.
    """
    settings = _settings()
    size, _, group = _tp() if settings["partition"] else (1, 0, None)
    options = CheckpointOptions(
        Distribute.EVERY if size > 1 else None, settings["cpu"], False, group
    )
    timer = _Timer(settings, "fwd")
    out = checkpoint_without_reentrant(function, options, args, {}, None, False, True)
    timer.stop()
    return out
