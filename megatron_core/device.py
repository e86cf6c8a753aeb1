"""The one place that knows the device.

Everything else in megatron_core asks this module for the device type, the default
torch.distributed backend, the current device and the device's random generator. No other module
calls ``torch.cuda`` or names the NCCL backend, except the switch's CPU mode
(``megatron/cpu_mode.py``), which stands in for ``torch.cuda`` names under megatron-core's code.

How the device type is chosen, first match wins:

1. :func:`set_device_type` was called (``"cpu"`` or ``"cuda"``);
2. the environment variable ``MEGATRON_CORE_DEVICE`` is ``cpu`` or ``cuda``;
3. torch.distributed is initialized with a backend that puts NCCL on CUDA tensors -> ``cuda``:
   ``"nccl"``, or a per-device map such as ``"cuda:nccl,cpu:gloo"`` (what torch's
   ``init_process_group()`` without a backend picks on a GPU machine), see
   :func:`backend_uses_cuda`;
4. otherwise ``cpu``.

CUDA is never chosen implicitly on a machine that merely has a GPU: a user asks for it (2 or 1) or
launches with NCCL (3). On a CPU-only torch build nothing here touches ``torch.cuda`` unless CUDA
was asked for, in which case a clear error is raised.

NOTE [ CUDA first call ]
1. torch initializes CUDA lazily: ``torch.cuda.default_generators`` is an empty tuple until the
   first call that initializes it (``torch.cuda.init()``, ``current_device()``, a CUDA tensor).
   Seeding may be a process's first CUDA call, so every read of that tuple here runs
   ``torch.cuda.init()`` first, as its own statement (in ``default_generators[current_device()]``
   Python reads the still-empty tuple before the index expression initializes CUDA).
2. Nothing else here reads CUDA state that exists only after initialization.
3. tests/test_device_fake_cuda.py runs these paths on a CPU-only build against a fake
   ``torch.cuda`` that behaves lazily like the real one.

NOTE [ The allocator's total on the CPU ]
1. On CUDA the allocator counts every live tensor's bytes (``torch.cuda.memory_allocated``,
   ``max_memory_allocated`` since ``reset_peak_memory_stats``). torch's CPU allocator keeps no
   such counter, so :func:`allocated_bytes` takes a census on the CPU: every live CPU storage,
   each once, that the garbage collector's tensors and storages (and the gradients of the leaf
   tensors among them) lead to, and that torch's allocator made (a resizable storage: not
   numpy's, a file's or a Python buffer's memory, which torch only wraps). Tensors in reference
   cycles the collector has not reached yet are among them (as in ``memory_allocated``): the
   recompute planner's census and its measured totals collect first, since when the collector
   runs depends on what every thread allocated.
2. What it cannot see: storages only C++ holds (an autograd graph's saved tensors, a
   collective's buffers while gloo's worker still has them). Between training steps there are
   none of the first, and the second are freed as the collective ends; so the census is taken
   as a step begins, and a step's peak above it is read from the allocator's events
   (tensor_parallel/recompute/planner/probe.MemoryTimeline). tests/tensor_parallel/recompute/
   test_plan_total.py checks the census against torch's profiler switched on before the model
   was built (every block's size known) on our GPT and on megatron-core's GPTModel.
3. It costs a walk over the collector's objects (about 0.1 s with megatron-core imported on a
   2-core machine): a few reads per plan or measured step, not per operation.
"""

from __future__ import annotations

import gc
import os
import time
import warnings

import torch

from megatron_core import compat, flags
from megatron_core.errors import MegatronCoreError

__all__ = [
    "set_device_type",
    "device_type",
    "backend_uses_cuda",
    "warn_if_overlap_is_serialized",
    "is_accelerator",
    "default_backend",
    "mixed_backend",
    "current_device",
    "set_current_device",
    "accelerator_count",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "device_generator",
    "synchronize",
    "memory_allocated",
    "max_memory_allocated",
    "allocated_bytes",
    "StepTimer",
    "reset_peak_memory_stats",
    "total_memory",
    "keep_freed_host_memory",
    "nvtx_range_push",
    "nvtx_range_pop",
]

_SUPPORTED = ("cpu", "cuda")
_explicit_device_type: str | None = None


def _validate(kind: str, source: str) -> str:
    if kind not in _SUPPORTED:
        raise MegatronCoreError(f"{source} ({kind!r}) must be one of {_SUPPORTED}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise MegatronCoreError(
            f"{source} is 'cuda' but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use 'cpu'"
        )
    return kind


def set_device_type(kind: str | None) -> None:
    """Choose the device type for the whole process: ``"cpu"``, ``"cuda"``, or None to re-detect."""
    global _explicit_device_type
    _explicit_device_type = None if kind is None else _validate(kind, "device type")


def device_type() -> str:
    """Return ``"cpu"`` or ``"cuda"``: where megatron_core puts tensors (see module doc)."""
    if _explicit_device_type is not None:
        return _explicit_device_type
    env = flags.choice("MEGATRON_CORE_DEVICE", _SUPPORTED)
    if env:
        return _validate(env, "MEGATRON_CORE_DEVICE")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and backend_uses_cuda(_initialized_backend()):
        return "cuda"
    return "cpu"


def _initialized_backend() -> str:
    """The default group's backend string, with its per-device map where torch keeps one."""
    return compat.backend_config_text()


def backend_uses_cuda(backend: str | None) -> bool:
    """True when the torch.distributed ``backend`` string puts NCCL on CUDA tensors.

    Accepts every form ``init_process_group`` takes or ``get_backend``/``get_backend_config``
    return: ``"nccl"`` (any case), and per-device maps ``"cuda:nccl,cpu:gloo"`` /
    ``"cpu:gloo,cuda:nccl"``. ``"gloo"``, ``"cpu:gloo"``, None and unknown strings give False.
    """
    if not backend:
        return False
    for entry in str(backend).lower().replace(" ", "").split(","):
        kind, _, name = entry.rpartition(":")
        if name == "nccl" and kind in ("", "cuda"):
            return True
    return False


def is_accelerator() -> bool:
    """True when the device type is an accelerator (cuda), False on cpu."""
    return device_type() != "cpu"


def default_backend() -> str:
    """The torch.distributed backend for the device type: ``nccl`` on cuda, ``gloo`` on cpu."""
    return "nccl" if device_type() == "cuda" else "gloo"


def mixed_backend() -> str:
    """The backend for a default group that carries device tensors and CPU tensors alike:
    torch's per-device map ``cuda:nccl,cpu:gloo`` on cuda, ``gloo`` on cpu."""
    return "cuda:nccl,cpu:gloo" if device_type() == "cuda" else "gloo"


def current_device() -> torch.device:
    """The device new tensors go to: ``cuda:<current index>`` or ``cpu``."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def accelerator_count() -> int:
    """How many accelerators (GPUs) this process can see; 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def set_current_device(local_rank: int) -> None:
    """Bind this process to accelerator ``local_rank`` (a no-op on cpu)."""
    if device_type() == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def device_generator() -> torch.Generator:
    """The default random generator of the current device (the CPU generator on cpu)."""
    if device_type() == "cuda":
        torch.cuda.init()  # NOTE [ CUDA first call ], rule 1
        index = torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def get_rng_state() -> torch.Tensor:
    """A copy of the current device generator's state (a ByteTensor on the CPU)."""
    if device_type() == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    """Set the current device generator's state from ``state`` (as returned by get_rng_state)."""
    if device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator only (on cpu, that is the CPU generator)."""
    if device_type() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def synchronize() -> None:
    """Wait for all queued work on the current device (a no-op on cpu)."""
    if device_type() == "cuda":
        torch.cuda.synchronize()


def memory_allocated() -> int:
    """Bytes currently allocated by torch on the device; 0 on cpu (torch does not track it)."""
    return torch.cuda.memory_allocated() if device_type() == "cuda" else 0


def max_memory_allocated() -> int:
    """Peak bytes allocated on the device since the last reset; 0 on cpu."""
    return torch.cuda.max_memory_allocated() if device_type() == "cuda" else 0


def allocated_bytes() -> int:
    """Bytes the device's allocator holds for live tensors now, nothing left out:
    ``torch.cuda.memory_allocated()`` on cuda; on the cpu, which keeps no such counter, the
    census of NOTE [ The allocator's total on the CPU ] (read it between steps)."""
    if device_type() == "cuda":
        return torch.cuda.memory_allocated()
    return sum(_cpu_storages().values())


def _cpu_storages() -> dict[int, int]:
    """NOTE [ The allocator's total on the CPU ], rule 1: ``{address: bytes}`` of the live CPU
    storages torch's allocator made, reached from the garbage collector's objects."""
    found: dict[int, int] = {}

    def add(storage) -> None:
        try:
            if storage.device.type != "cpu" or not storage.resizable():
                return
            address = storage.data_ptr()
            if address:
                found[address] = storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            return  # no addressable storage: a sparse, meta or wrapper-subclass tensor

    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some objects warn on
        if issubclass(kind, torch._C.TensorBase):
            try:
                add(obj.untyped_storage())
                grad = obj.grad if obj.is_leaf and obj.requires_grad else None
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if grad is not None:
                add(grad.untyped_storage())
        elif issubclass(kind, torch.UntypedStorage):
            add(obj)
        elif issubclass(kind, torch.TypedStorage):
            add(obj.untyped_storage())
    return found


class StepTimer:
    """Milliseconds of one region's work on this rank that other processes on the machine do not
    move: on cuda the device's time between two CUDA events recorded on the current stream; on
    the cpu this thread's CPU time (``time.thread_time``), or the process's
    (``time.process_time``) where torch runs an operation on several threads, whose work this
    thread's clock would not count. Waiting (for a peer rank, for a core another process holds)
    is not work and is not counted on the cpu.

    Use: ``with device.StepTimer() as timer: ...``, then ``timer.ms``.
    """

    def __init__(self) -> None:
        self.ms = 0.0
        self._events = None
        self._clock = time.thread_time_ns if torch.get_num_threads() == 1 else time.process_time_ns
        self._start = 0

    def __enter__(self) -> StepTimer:
        if device_type() == "cuda":
            self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._events[0].record()
        else:
            self._start = self._clock()
        return self

    def __exit__(self, *exc) -> None:
        if self._events is not None:
            self._events[1].record()
            self._events[1].synchronize()
            self.ms = self._events[0].elapsed_time(self._events[1])
        else:
            self.ms = (self._clock() - self._start) / 1e6


def total_memory() -> int:
    """Bytes of memory of the current device; on cpu, the machine's physical memory."""
    if device_type() == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)


def keep_freed_host_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Have glibc's malloc keep the host memory it frees for reuse: blocks below
    ``mmap_threshold`` bytes come from the heap instead of an mmap of their own, and the heap is
    not trimmed (returned to the kernel) until 2 GiB of it is free. With glibc's defaults a
    large CPU tensor freed in one training step (an attention's ``[b, np, s, s]`` scores) can
    go back to the kernel and be faulted in again, page by page, in the next, and how often
    depends on the process's history: on a shared 2-core VM one recompute plan of a 6-layer GPT
    read 5.6k and 27.6k minor faults per step in two processes (349.6 and 397.0 ms of CPU), and
    none with this. Process-wide and for the process's life; touches no device allocator.
    Returns whether glibc took both settings (where the threshold is above what it takes, it
    is tried at 32 MiB, glibc's own ceiling for the dynamic one); False, with nothing done,
    where the C library is not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own name: not glibc raises here)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) (Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = mallopt(_M_MMAP_THRESHOLD, min(int(mmap_threshold), (1 << 31) - 1)) == 1
    if not took:
        took = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    return took and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1


def reset_peak_memory_stats() -> None:
    """Reset the device's peak-memory counter (a no-op on cpu)."""
    if device_type() == "cuda":
        torch.cuda.reset_peak_memory_stats()


def nvtx_range_push(msg: str) -> None:
    """Open an NVTX range named ``msg`` for profilers (``torch.cuda.nvtx``); a no-op on cpu."""
    if device_type() == "cuda":
        torch.cuda.nvtx.range_push(msg)


def nvtx_range_pop() -> None:
    """Close the innermost NVTX range opened by :func:`nvtx_range_push`; a no-op on cpu."""
    if device_type() == "cuda":
        torch.cuda.nvtx.range_pop()


_OVERLAP_WARNED: set[str] = set()


def warn_if_overlap_is_serialized(tensor: torch.Tensor, feature: str) -> None:
    """Warn once per ``feature`` when a CUDA overlap needs ``CUDA_DEVICE_MAX_CONNECTIONS=1``.

    The overlapped linear backward (sequence parallelism, async tensor-model-parallel
    all-reduce) queues a collective before the matmul that should hide it; with more than one
    device connection the GPU may run them in another order and the overlap is lost (results do
    not change). megatron-core warns the same way. Nothing happens for non-CUDA tensors.

    Args:
        tensor: an input of the overlapped computation; only its device type is read.
        feature: what overlaps, named in the warning (e.g. "sequence parallelism").
    """
    if tensor.device.type != "cuda" or feature in _OVERLAP_WARNED:
        return
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return
    _OVERLAP_WARNED.add(feature)
    warnings.warn(
        f"When using {feature} it is recommended to set the environment variable "
        f"CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup (it is "
        f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')!r})",
        stacklevel=3,
    )
