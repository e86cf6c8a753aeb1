"""The switch's CPU mode: megatron-core's CUDA-only code runs on the CPU without a user patch.

This is the one module of the package that replaces ``torch.cuda`` names and turns the "nccl"
backend into gloo (device.py names it as the one exception to its rule). :func:`configure` is called
by ``megatron_core.megatron.install``; every name it answers is in :data:`ANSWERED`.

# NOTE [ CUDA on the CPU ]
1. When. ``install(cuda_on_cpu=...)`` decides: True / False turn the mode on / off; None (the
   default) reads ``MEGATRON_CORE_CUDA_ON_CPU`` (1/true/yes/on or 0/false/no/off) and, if that is
   unset, turns the mode on exactly when torch has no usable CUDA device
   (``torch.cuda.is_available()`` is False). With a GPU, auto mode does nothing.
2. Devices. A ``torch.overrides.TorchFunctionMode`` on this thread's torch-function mode stack
   rewrites every device argument that names CUDA (``"cuda"``, ``"cuda:N"``, a CUDA
   ``torch.device``, an integer index such as ``torch.cuda.current_device()``'s 0) to the CPU: the
   ``device=`` keyword of any torch function (factories, ``Tensor.new_*``, ``Tensor.to``) and the
   first positional argument of ``Tensor.to``. ``Tensor.cuda()`` returns the tensor itself, so
   ``Module.cuda()`` moves nothing, and ``Tensor.type()`` names a CPU tensor's type as CUDA's
   (``torch.cuda.FloatTensor``: megatron-core's optimizers assert it). Arguments that do not
   name CUDA pass untouched, so this package's own code (which never names CUDA) runs as
   without the mode.
3. Re-entry. torch takes a mode off the stack while its handler runs, so code that autograd's
   entry points run (hooks, a custom ``Function.backward``, reentrant checkpointing) would run
   without it. For ``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad``
   the handler puts the mode back and redispatches (``torch.overrides.redispatch_function``,
   ``compat.redispatch_torch_function``); where torch lacks that (2.6 and 2.11 lack it), those run
   without the mode, except this package's checkpoint recomputes, which enter the forward's
   torch-function modes again (NOTE [ Checkpoint rules ], rule 2).
4. Threads. torch's mode stack belongs to a thread: the mode is pushed in the thread that turns
   the CPU mode on (autograd's engine carries it into backward). Another thread that makes
   tensors on "cuda" is not covered; every replaced ``torch.cuda`` name is (rule 5).
5. Names. The ``torch.cuda`` names in :data:`ANSWERED` are replaced by CPU stand-ins: the current
   device is 0, ``set_device`` / ``synchronize`` do nothing, streams and events are CPU objects
   that are always complete, and CUDA's random generator is the device stream, a state kept
   apart from the CPU generator (NOTE [ RNG streams ], rule 6): the mode's torch.cuda seeding
   and state names read and write it, and the mode runs every ``torch.nn.functional`` dropout
   and every random factory whose device names CUDA inside ``device_rng()``, so a host-side
   draw on some ranks only (a data loader on TP rank 0) cannot change the dropout masks of
   activations replicated across a TP group, as on a GPU. ``device_count()`` is
   the number of processes on this node (torchrun's ``LOCAL_WORLD_SIZE``, 1 without it): one
   device per local rank, as on the GPU node megatron-core's launch code assumes (its tests'
   ``set_device(rank % device_count())`` divides by it). ``is_available()`` keeps torch's answer
   (False): megatron-core asks it to choose CUDA-only work (memory statistics, Transformer
   Engine, Triton kernels), so its code takes the path that runs on a CPU, and its unit tests
   that skip without CUDA still skip.
6. Groups. ``init_process_group`` and ``new_group`` asked for NCCL (``"nccl"`` or a map such as
   ``"cuda:nccl,cpu:gloo"``) make a gloo group; the NCCL ``pg_options`` and a CUDA ``device_id``
   that came with the request are dropped. A ``new_group`` whose rank list differs between
   ranks (which NCCL's lazy connection lets pass, and gloo's eager one would wait on forever)
   is served: every distinct list becomes a group on every rank, each rank gets its own; lists
   that overlap without being equal raise on every rank (NOTE [ Rank lists per rank ], in
   group_lists.py).
7. Off. :func:`disable` puts every replaced name back and takes the mode off the stack, wherever
   it is; turning the mode on twice pushes it once. The mode warns once per process when it is
   first turned on (a ``UserWarning`` naming how to turn it off).
8. Undefined names. A megatron-core module in :data:`COMPLETED` that leaves one of its names
   undefined where Transformer Engine is absent (a NameError on first use; Transformer Engine is
   never there on a CPU) gets the value megatron-core's later releases give it there, when the
   module is imported or, if it already is, when the mode turns on. A name the module defines is
   left alone; :func:`disable` removes only what the mode added.
9. Megatron-LM's training script. Megatron-LM's ``pretrain_gpt.py`` (its ``megatron.training``
   and ``megatron.legacy`` packages, which are on no package index) asks for a GPU where no
   megatron-core module does. The mode answers each such wall where it is asked, and only there:
   the functions of :data:`ADAPTED` are wrapped when their module is imported (or at once, if it
   already is): ``initialize_megatron`` no longer asserts ``torch.cuda.is_available()`` (its own
   ``allow_no_cuda`` defaults to True), ``compile_helpers`` builds nothing where the prebuilt
   dataset extension a megatron-core wheel ships imports, and the legacy ``fused_kernels.load``
   does nothing without a CUDA toolkit (that release builds no kernel; it only asks nvcc for
   its version). ``torch.cuda.get_device_properties`` answers an Ampere-like device (rule 5)
   with the fields Megatron and torch's inductor read, and ``CUDA_DEVICE_MAX_CONNECTIONS`` is
   set to 1 where it is unset (Megatron-LM asserts it under tensor or context parallelism on
   devices before Blackwell). :func:`disable` puts every original back and unsets what the
   mode set.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_core import compat, device, flags
from megatron_core.errors import MegatronCoreError
from megatron_core.megatron._finder import PostImportFinder
from megatron_core.megatron.group_lists import new_group_per_rank
from megatron_core.tensor_parallel import random as tp_random

__all__ = [
    "ENV",
    "ANSWERED",
    "COMPLETED",
    "ADAPTED",
    "CpuStream",
    "CpuEvent",
    "CpuDeviceProperties",
    "wanted",
    "configure",
    "enable",
    "disable",
    "is_active",
]

ENV = "MEGATRON_CORE_CUDA_ON_CPU"

# Every CUDA name the CPU mode answers -> what it answers (the manual's docs/guides/cpu-mode.md
# lists the same names; tests/megatron/test_megatron_cpu_mode.py checks that the list, the guide
# and the replaced names agree).
# torch.cuda.* and torch.distributed.* names are replaced attributes (NOTE rules 5 and 6); the
# torch.Tensor / torch.nn.Module / torch.nn.functional.dropout / torch.rand names are answered
# through the torch-function mode (rules 2 and 5); the megatron.* names are module names the mode
# defines where megatron-core did not (rule 8) or functions of Megatron-LM's training script it
# wraps (rule 9, with CUDA_DEVICE_MAX_CONNECTIONS).
ANSWERED: dict[str, str] = {
    "torch.cuda.current_device": "0 (an index the mode reads as the CPU)",
    "torch.cuda.set_device": "does nothing",
    "torch.cuda.device_count": "the processes on this node (LOCAL_WORLD_SIZE; 1 without it)",
    "torch.cuda.synchronize": "does nothing",
    "torch.cuda.current_stream": "the current CpuStream",
    "torch.cuda.default_stream": "the default CpuStream",
    "torch.cuda.Stream": "CpuStream (a torch.cpu.Stream; complete at once)",
    "torch.cuda.stream": "context that makes a CpuStream current",
    "torch.cuda.Event": "CpuEvent (complete at once; elapsed_time from the wall clock)",
    "torch.cuda.get_device_properties": "an Ampere-like device: major 8, minor 0, name, "
    "gcnArchName '', total_memory (the host's), multi_processor_count (the CPUs)",
    "torch.cuda.manual_seed": "seeds the device stream, kept apart from the CPU generator",
    "torch.cuda.manual_seed_all": "seeds the device stream, kept apart from the CPU generator",
    "torch.cuda.get_rng_state": "the device stream's state",
    "torch.cuda.set_rng_state": "sets the device stream's state",
    "torch.cuda.random.manual_seed": "as torch.cuda.manual_seed (megatron-core's own random.py "
    "calls this module's names)",
    "torch.cuda.random.manual_seed_all": "as torch.cuda.manual_seed_all",
    "torch.cuda.random.get_rng_state": "as torch.cuda.get_rng_state",
    "torch.cuda.random.set_rng_state": "as torch.cuda.set_rng_state",
    "torch.nn.functional.dropout": "draws from the device stream (also dropout1d/2d/3d, "
    "alpha_dropout, feature_alpha_dropout), not from host-side draws",
    "torch.rand": "with a device naming CUDA, draws from the device stream (also randn, "
    "randint, randperm, normal)",
    "torch.distributed.init_process_group": "gloo where NCCL is asked for",
    "torch.distributed.new_group": "gloo where NCCL is asked for; rank lists that differ "
    "between ranks: each distinct list a group on every rank, each rank its own (overlapping "
    "lists raise on every rank)",
    "torch.Tensor.to": "a device naming CUDA is the CPU",
    "torch.Tensor.cuda": "the tensor itself",
    "torch.Tensor.type": "a CPU tensor's type named as on CUDA (torch.cuda.FloatTensor)",
    "torch.nn.Module.cuda": "moves nothing (through torch.Tensor.cuda)",
    "megatron.core.transformer.moe.moe_utils.te_general_gemm": "None where the module left it "
    "undefined (megatron-core 0.16.1 without Transformer Engine), so the MoE router's gating "
    "takes its torch path",
    "megatron.training.initialize.initialize_megatron": "allow_no_cuda defaults to True "
    "(Megatron-LM's pretrain() never passes it; initialize.py asserts CUDA without it)",
    "megatron.core.datasets.utils.compile_helpers": "builds nothing where the prebuilt "
    "megatron.core.datasets.helpers_cpp imports (a wheel ships it but no Makefile)",
    "megatron.legacy.fused_kernels.load": "does nothing without a CUDA toolkit (CUDA_HOME is "
    "None; the release only reads nvcc's version)",
    "CUDA_DEVICE_MAX_CONNECTIONS": "set to 1 where unset (Megatron-LM's arguments.py asserts it "
    "under tensor or context parallelism before Blackwell)",
}

# NOTE rule 8: megatron-core module -> {name: value} the mode defines where the module did not.
# megatron-core 0.16.1's moe_utils binds te_general_gemm only when Transformer Engine imports,
# and its RouterGatingLinearFunction reads it unconditionally; 0.19 binds None there.
COMPLETED: dict[str, dict[str, object]] = {
    "megatron.core.transformer.moe.moe_utils": {"te_general_gemm": None},
}


def _allow_no_cuda(original):
    """NOTE rule 9: Megatron-LM's initialize_megatron with allow_no_cuda defaulting to True."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        bound.arguments.setdefault("allow_no_cuda", True)
        return original(*bound.args, **bound.kwargs)

    return initialize_megatron


def _prebuilt_helpers(original):
    """NOTE rule 9: compile_helpers that builds nothing where the prebuilt extension imports."""

    @functools.wraps(original)
    def compile_helpers():
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            return original()
        return None

    return compile_helpers


def _no_nvcc(original):
    """NOTE rule 9: the legacy fused-kernel probe, a no-op without a CUDA toolkit."""

    @functools.wraps(original)
    def load(args):
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            return None
        return original(args)

    return load


# NOTE rule 9: module -> {function name: adapter(original) -> the wrapped function}.
ADAPTED: dict[str, dict[str, object]] = {
    "megatron.training.initialize": {"initialize_megatron": _allow_no_cuda},
    "megatron.core.datasets.utils": {"compile_helpers": _prebuilt_helpers},
    "megatron.legacy.fused_kernels": {"load": _no_nvcc},
}
_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"

_CPU = torch.device("cpu")


@dataclass
class _State:
    mode: _CudaOnCpu | None = None  # the torch-function mode while the CPU mode is on
    originals: dict = field(default_factory=dict)  # (owner, name) -> what was replaced
    warned: bool = False  # the one-time warning was given
    finder: PostImportFinder | None = None  # completes modules imported later (COMPLETED)
    added: list = field(default_factory=list)  # (module, name) set where none was before
    env_set: bool = False  # enable() set CUDA_DEVICE_MAX_CONNECTIONS itself


_STATE = _State()


def _names_cuda(where) -> bool:
    """Whether a device argument means a CUDA device (NOTE rule 2)."""
    if isinstance(where, str):
        return where == "cuda" or where.startswith("cuda:")
    if isinstance(where, torch.device):
        return where.type == "cuda"
    return isinstance(where, int) and not isinstance(where, bool)


class _CudaOnCpu(TorchFunctionMode):
    """NOTE [ CUDA on the CPU ] rules 2 and 3: device arguments naming CUDA mean the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DEVICE_DRAWS or (
            func in _FACTORY_DRAWS and kwargs and _names_cuda(kwargs.get("device"))
        ):
            with tp_random.device_rng():  # NOTE rule 5 and NOTE [ RNG streams ], rule 6
                return self._run(func, types, args, kwargs)
        return self._run(func, types, args, kwargs)

    def _run(self, func, types, args, kwargs):
        if kwargs and _names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TO and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is _TENSOR_TYPE:
            return _tensor_type(*args, **(kwargs or {}))
        if func in _AUTOGRAD_ENTRIES:
            return compat.redispatch_torch_function(self, func, types, args, kwargs or {})
        return func(*args, **(kwargs or {}))


_TENSOR_CUDA = torch.Tensor.cuda
# NOTE rule 5: draws that a GPU would make from CUDA's generator (dropout is always applied to
# device activations; a factory only when its device names CUDA).
_F = torch.nn.functional
_DEVICE_DRAWS = frozenset(
    {
        _F.dropout,
        _F.dropout1d,
        _F.dropout2d,
        _F.dropout3d,
        _F.alpha_dropout,
        _F.feature_alpha_dropout,
        torch.dropout,
        torch.alpha_dropout,
        torch.feature_dropout,
        torch.feature_alpha_dropout,
    }
)
_FACTORY_DRAWS = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal})
_TENSOR_TO = torch.Tensor.to
_TENSOR_TYPE = torch.Tensor.type


def _tensor_type(tensor, dtype=None, non_blocking=False, **kwargs):
    """NOTE rule 2: ``Tensor.type()`` names a CPU tensor's type as on CUDA
    (``torch.cuda.FloatTensor``), and a conversion to a CUDA type name converts to the CPU one."""
    if dtype is None and not kwargs:
        name = _TENSOR_TYPE(tensor)
        if tensor.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
            return "torch.cuda." + name[len("torch.") :]
        return name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda.") :]
    return _TENSOR_TYPE(tensor, dtype, non_blocking, **kwargs)


_AUTOGRAD_ENTRIES = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})


class CpuStream(compat.CPU_STREAM_BASE):
    """What ``torch.cuda.Stream`` is in CPU mode: the CPU runs work in order, so a stream is
    always complete and waiting on it or on an event returns at once.

    Args:
        device: ignored (the CPU).
        priority: kept as ``priority``; it changes nothing.
    """

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.priority = priority
        self.device = _CPU

    def wait_stream(self, stream) -> None:
        """Nothing to wait for."""

    def wait_event(self, event) -> None:
        """Nothing to wait for."""

    def record_event(self, event=None):
        """Record ``event`` (a new :class:`CpuEvent` when None) and return it."""
        event = CpuEvent() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always True: the work is done."""
        return True


class CpuEvent:
    """What ``torch.cuda.Event`` is in CPU mode. ``torch.Event`` cannot record on the CPU ("cpu
    backend doesn't support events"), so this records the wall clock; it is complete at once.

    Args:
        enable_timing: kept; :meth:`elapsed_time` works either way.
        blocking, interprocess: ignored.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs) -> None:
        self.enable_timing = enable_timing
        self._at: float | None = None

    def record(self, stream=None) -> None:
        """Note the time."""
        self._at = time.perf_counter()

    def wait(self, stream=None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always True."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s.

        Raises:
            MegatronCoreError: one of the two events was never recorded.
        """
        if self._at is None or end_event._at is None:
            raise MegatronCoreError(
                f"CpuEvent.elapsed_time: both events must be recorded first (start recorded: "
                f"{self._at is not None}, end recorded: {end_event._at is not None})"
            )
        return (end_event._at - self._at) * 1000.0


_DEFAULT_STREAM = CpuStream()
_STREAMS: list[CpuStream] = [_DEFAULT_STREAM]


class _StreamContext:
    """``torch.cuda.stream(s)``: ``s`` is the current stream inside (None changes nothing). It
    can be entered again after it exits, as torch's StreamContext can (megatron-core's DDP
    enters one twice)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self):
        _STREAMS.append(_STREAMS[-1] if self.stream is None else self.stream)
        return self.stream

    def __exit__(self, *exc_info) -> bool:
        _STREAMS.pop()
        return False


def _stream(stream) -> _StreamContext:
    """``torch.cuda.stream(s)`` (NOTE rule 5)."""
    return _StreamContext(stream)


def _seed(seed: int) -> None:
    # NOTE rule 5: CUDA's generator is the device stream. torch.manual_seed calls this too
    # (through torch.cuda.manual_seed_all) after seeding the CPU generator.
    tp_random.device_manual_seed(int(seed))


def _device_count() -> int:
    """NOTE rule 5: one device per process on this node (torchrun's LOCAL_WORLD_SIZE, else 1).

    Raises:
        MegatronCoreError: ``LOCAL_WORLD_SIZE`` is set but is not a positive integer (the message
            names the value).
    """
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise MegatronCoreError(
            f"CPU mode: torch.cuda.device_count() reads LOCAL_WORLD_SIZE={value!r}, which is not "
            f"a positive integer (torchrun sets it to the number of processes on this node)"
        )
    return int(value)


def _get_rng_state(device="cuda") -> torch.Tensor:
    """NOTE rule 5: CUDA's generator state is the device stream's."""
    return tp_random.get_device_rng_state()


def _set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    tp_random.set_device_rng_state(new_state)


def _gloo_for_nccl(original):
    """``original`` (init_process_group / new_group) with NOTE rule 6 applied."""
    signature = inspect.signature(original)

    def make_group(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        if device.backend_uses_cuda(arguments.get("backend")):
            arguments["backend"] = "gloo"
            if "pg_options" in arguments:
                arguments["pg_options"] = None
        if _names_cuda(arguments.get("device_id")):
            arguments["device_id"] = None
        if original.__name__ == "new_group":
            return new_group_per_rank(original, bound)  # NOTE [ Rank lists per rank ]
        return original(*bound.args, **bound.kwargs)

    make_group.__name__ = original.__name__
    make_group.__doc__ = f"CPU mode's {original.__name__}: gloo where NCCL is asked for."
    return make_group


def _stand_ins() -> dict[tuple[object, str], object]:
    """(module, attribute) -> the CPU stand-in, for every replaced name of :data:`ANSWERED`."""
    cuda = torch.cuda
    return {
        (cuda, "current_device"): lambda: 0,
        (cuda, "set_device"): lambda device=None: None,
        (cuda, "device_count"): _device_count,
        (cuda, "synchronize"): lambda device=None: None,
        (cuda, "current_stream"): lambda device=None: _STREAMS[-1],
        (cuda, "default_stream"): lambda device=None: _DEFAULT_STREAM,
        (cuda, "Stream"): CpuStream,
        (cuda, "stream"): _stream,
        (cuda, "Event"): CpuEvent,
        (cuda, "get_device_properties"): lambda device=None: CpuDeviceProperties(),
        (cuda, "manual_seed"): _seed,
        (cuda, "manual_seed_all"): _seed,
        (cuda, "get_rng_state"): _get_rng_state,
        (cuda, "set_rng_state"): _set_rng_state,
        (cuda.random, "manual_seed"): _seed,
        (cuda.random, "manual_seed_all"): _seed,
        (cuda.random, "get_rng_state"): _get_rng_state,
        (cuda.random, "set_rng_state"): _set_rng_state,
        (dist, "init_process_group"): _gloo_for_nccl(dist.init_process_group),
        (dist, "new_group"): _gloo_for_nccl(dist.new_group),
    }


def _complete(module) -> None:
    """Define :data:`COMPLETED`'s names that ``module`` left undefined (NOTE rule 8) and wrap
    :data:`ADAPTED`'s functions (NOTE rule 9)."""
    for name, value in COMPLETED.get(module.__name__, {}).items():
        if not hasattr(module, name):
            setattr(module, name, value)
            _STATE.added.append((module, name))
    originals = _STATE.originals
    for name, adapter in ADAPTED.get(module.__name__, {}).items():
        original = getattr(module, name, None)
        if callable(original) and (module, name) not in originals:
            originals[(module, name)] = original
            setattr(module, name, adapter(original))


class CpuDeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers in CPU mode (NOTE rule 9): an
    Ampere-like device (compute capability 8.0), so code that picks a path by architecture
    takes the one for GPUs before Hopper, with the fields Megatron and torch's inductor read."""

    def __init__(self) -> None:
        self.name = "CPU (megatron_core CPU mode)"
        self.major, self.minor = 8, 0
        self.gcnArchName = ""
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        self.total_memory = int(pages) * int(page_size)
        self.multi_processor_count = os.cpu_count() or 1
        self.is_integrated = False
        self.is_multi_gpu_board = False

    def __repr__(self) -> str:
        return (
            f"CpuDeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // 2**20}MB, "
            f"multi_processor_count={self.multi_processor_count})"
        )


def is_active() -> bool:
    """Whether the CPU mode is on in this process."""
    return _STATE.mode is not None


def wanted(cuda_on_cpu: bool | None = None) -> bool:
    """Whether the CPU mode should be on (NOTE [ CUDA on the CPU ], rule 1).

    Raises:
        MegatronCoreError: ``MEGATRON_CORE_CUDA_ON_CPU`` is set to something else than
            1/true/yes/on or 0/false/no/off (the message names the value).
    """
    if cuda_on_cpu is not None:
        return bool(cuda_on_cpu)
    value = flags.flag(ENV)
    return not torch.cuda.is_available() if value is None else value


def configure(cuda_on_cpu: bool | None = None) -> bool:
    """Turn the CPU mode on or off as :func:`wanted` says; returns whether it is on."""
    if wanted(cuda_on_cpu):
        enable()
    else:
        disable()
    return is_active()


def enable() -> None:
    """Turn the CPU mode on (idempotent): replace the names, push the mode, warn once."""
    if is_active():
        return
    originals = _STATE.originals
    for (module, name), stand_in in _stand_ins().items():
        originals[(module, name)] = getattr(module, name)
        setattr(module, name, stand_in)
    finder = PostImportFinder(lambda name: name in COMPLETED or name in ADAPTED, _complete)
    sys.meta_path.insert(0, finder)
    _STATE.finder = finder
    for name in (*COMPLETED, *ADAPTED):
        if name in sys.modules:
            _complete(sys.modules[name])
    if _MAX_CONNECTIONS not in os.environ:  # NOTE rule 9
        os.environ[_MAX_CONNECTIONS] = "1"
        _STATE.env_set = True
    tp_random.keep_device_stream_apart(True)  # NOTE rule 5
    mode = _CudaOnCpu()
    mode.__enter__()
    _STATE.mode = mode
    if not _STATE.warned:
        _STATE.warned = True
        warnings.warn(
            "megatron switch: CPU mode is on: megatron-core's CUDA calls run on the CPU "
            "(devices naming cuda mean the CPU, nccl groups are gloo); turn it off with "
            f"install(cuda_on_cpu=False) or {ENV}=0",
            UserWarning,
            stacklevel=4,  # the caller of install() (install -> configure -> enable)
        )


def disable() -> None:
    """Undo :func:`enable` (NOTE rule 7); nothing happens when the mode is off."""
    originals = _STATE.originals
    while originals:
        (module, name), original = originals.popitem()
        setattr(module, name, original)
    finder, _STATE.finder = _STATE.finder, None
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    if _STATE.env_set:
        _STATE.env_set = False
        os.environ.pop(_MAX_CONNECTIONS, None)
    added = _STATE.added
    while added:
        module, name = added.pop()
        if hasattr(module, name):
            delattr(module, name)
    mode, _STATE.mode = _STATE.mode, None
    if mode is not None:
        _remove_from_stack(mode)


def _remove_from_stack(mode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack, the modes above it kept."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
