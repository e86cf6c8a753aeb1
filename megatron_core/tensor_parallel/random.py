"""RNG streams for tensor parallelism: the states tracker, seeding and RNG snapshots.

Megatron-compatible names (``CudaRNGStatesTracker``, ``get_cuda_rng_tracker``,
``model_parallel_cuda_manual_seed``); the "cuda" in them is Megatron's spelling. The tracker drives
the current device's generator through :mod:`megatron_core.device`: the CUDA generator of the
current GPU on cuda, the CPU generator on cpu. Audit and save/load live in ``rng/state.py``;
``checkpoint`` and friends are attached here by the ``tensor_parallel`` face (megatron-core's
path ``tensor_parallel.random.checkpoint``), from ``recompute/entry_points.py``.

# NOTE [ RNG streams ]
1. Streams. The tracker holds named generator states for the *device* generator. After
   ``model_parallel_cuda_manual_seed(seed)``::

     default generator     = seed   (outside any fork; also the CPU generator, see rule 6)
     "data-parallel-rng"   = seed
     "model-parallel-rng"  = seed + 2718 + tp_rank
     "expert-parallel-rng" = seed + 1024 + 100 * ep_rank + etp_rank   (etp: expert tensor parallel)

   These are megatron-core's names and values, so a ported model draws the same numbers.
2. Where each is used. Dropout on activations that are *replicated* across a TP group (outside
   tensor-parallel regions) draws from the default stream. Dropout on *split* activations (inside a
   TP region, e.g. attention probabilities per head shard) and init of split weights draw inside
   ``tracker.fork()`` ("model-parallel-rng"). Expert layers use "expert-parallel-rng".
3. What must hold (checked by ``audit_rng_streams``):

   a. default and "data-parallel-rng" are EQUAL across the ranks of a TP group;
   b. "model-parallel-rng" is DISTINCT across the ranks of a TP group and EQUAL across the
      data-parallel group (replicas holding the same TP shard);
   c. "expert-parallel-rng" is DISTINCT across the tensor x expert group and EQUAL across the
      data-modulo-expert group (replicas of the same expert shard).

   Break (a) and replicated activations get different masks on different TP ranks, so the shards
   disagree; break (b) and every shard drops the same units. Neither raises: training is wrong.
4. Fork. ``fork(name)`` swaps stream ``name`` into the device generator and, on exit (also when
   the body raises), stores the advanced state back and restores what was there before. Forks
   nest: entering a fork while stream X is active first writes X's in-flight state back, and
   leaving restores X from the tracker, so fork A > fork B > fork A draws exactly what the
   sequential forks A, B, A, B, A draw.
5. Snapshots are values; ``set_states`` is megatron-core's. ``get_states()`` returns copies
   (including the in-flight state of the active stream) and ``RNGSnapshot`` holds copies.
   ``set_states(d)`` keeps ``d`` itself, as megatron-core does (values of any type, no copy): a
   later fork writes the advanced state into ``d``. So ``set_rng_snapshot`` (what a checkpoint's
   recompute uses) hands the tracker a fresh copy of the snapshot's states each time: a second
   recompute from the same snapshot (backward with retain_graph=True) draws the same dropout
   masks. A snapshot also records which stream was active (the fork it was taken in) and
   restoring it makes that stream active again: a region checkpointed inside ``fork(A)`` is
   recomputed in backward, outside any fork, and a ``fork(A)`` nested in it must still write A's
   in-flight state back first (rule 4), exactly as it did in forward.
6. Devices. On cuda the tracker forks only the GPU generator; CPU draws inside a fork come from
   the (unforked) CPU generator, as in megatron-core. On cpu torch has one generator for both
   kinds of draw: host-side ones (a data loader's seed, a sampler, user code) and those CUDA's
   default generator would serve (dropout of replicated activations). Megatron builds its data
   iterator on TP rank 0 only, so a host draw there would shift rank 0's replicated dropout
   masks and the replicas would drift apart, silently (rule 3a broken by the host). So on cpu,
   once ``model_parallel_cuda_manual_seed`` (or the switch's CPU mode) has seeded it, the
   *device stream* (what CUDA's default generator would hold) is a state kept apart from the
   CPU generator. ``device_rng()`` swaps it into the CPU generator for the draws in its block
   and stores the advanced state back, as a fork does with a tracker stream. Draws that go
   through it: this package's transformer dropout outside forks, the RNG audit's default-stream
   draw, and under the CPU mode every ``torch.nn.functional`` dropout and every random factory
   whose device names CUDA. Forks load their stream into the CPU generator as before, so inside
   a fork every draw comes from that stream and ``device_rng()`` does nothing.
   ``get_device_rng_state`` / ``set_device_rng_state`` / ``device_manual_seed`` read, write and
   seed the device stream (inside a fork: the loaded stream, as torch.cuda's do on a GPU);
   snapshots record it beside the CPU generator, so recompute and checkpoints replay both.
   Seeding also seeds the CPU generator with ``seed``; python ``random`` and numpy are left to
   the caller. A dropout outside this package and outside the CPU mode (a user's own
   ``nn.Dropout`` on the package's CPU path) draws from the CPU generator: wrap it in
   ``device_rng()`` to get the same guarantee.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core import compat, device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.rng.graphs import (  # megatron-core's import path
    convert_cuda_rng_state,
    is_graph_safe_cuda_rng_tracker,
)

__all__ = [
    "CudaRNGStatesTracker",
    "InferenceCudaRNGStatesTracker",
    "initialize_rng_tracker",
    "get_cuda_rng_tracker",
    "get_all_rng_states",
    "model_parallel_cuda_manual_seed",
    "get_data_parallel_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_gtp_remat_rng_tracker_name",
    "RNGSnapshot",
    "get_rng_snapshot",
    "device_rng",
    "get_device_rng_state",
    "set_device_rng_state",
    "device_manual_seed",
    "keep_device_stream_apart",
    "get_generator_states",
    "set_generator_states",
    "set_rng_snapshot",
    "convert_cuda_rng_state",
    "is_graph_safe_cuda_rng_tracker",
]


def __getattr__(name: str) -> Any:
    """``HAVE_TE``: whether ``transformer_engine`` is importable now (megatron-core's module-level
    name, which its unit tests import from here), found without importing it; it is True while
    the megatron switch serves the Transformer Engine stand-in (NOTE [ Serving the Transformer
    Engine stand-in ], rule 4)."""
    if name == "HAVE_TE":  # a regular module, not a namespace package of that name
        spec = importlib.util.find_spec("transformer_engine")
        return spec is not None and spec.origin not in (None, "namespace")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the stream that is equal across TP ranks ("data-parallel-rng")."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_model_parallel_rng_tracker_name() -> str:
    """Name of the stream that differs across TP ranks ("model-parallel-rng", fork's default).

    See NOTE [ RNG streams ], rule 2 for where it is used.
    """
    return _MODEL_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the stream used by expert layers ("expert-parallel-rng")."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_gtp_remat_rng_tracker_name(is_expert: bool = False) -> str:
    """Name of megatron-core 0.19's generalized-TP remat RNG stream ("gtp-remat-rng", or
    "egtp-remat-rng" for experts). model_parallel_cuda_manual_seed registers it only for a
    remat size above 1, which is not implemented here, so it is never registered."""
    return "egtp-remat-rng" if is_expert else "gtp-remat-rng"


def _copy_state(state: Any) -> Any:
    """A value copy of one generator state (a ByteTensor or a graph-safe Generator); any other
    value (megatron-core's set_states accepts anything) is returned as it is."""
    if isinstance(state, torch.Generator):
        return state.clone_state()
    return state.clone() if isinstance(state, torch.Tensor) else state


def _graph_safe_supported() -> bool:
    return device.is_accelerator() and compat.graph_safe_generators()


class CudaRNGStatesTracker:
    """Named states of the device generator, swapped in by :meth:`fork`.

    See NOTE [ RNG streams ]. Works on cpu (drives the CPU generator) and cuda (the current GPU's
    generator).

    Args:
        use_cudagraphable_rng: keep streams as graph-safe generator states (CUDA graphs can
            capture draws from them). Needs an accelerator and a torch with
            ``Generator.graphsafe_get_state``; raises MegatronCoreError otherwise.
        is_inference_rng_tracker: accepted for megatron-core compatibility; use
            :class:`InferenceCudaRNGStatesTracker` (or ``initialize_rng_tracker``) for no-op forks.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        if use_cudagraphable_rng and not _graph_safe_supported():
            raise MegatronCoreError(
                f"use_cudagraphable_rng=True needs an accelerator device and a torch with "
                f"Generator.graphsafe_get_state; device type is {device.device_type()!r}, "
                f"torch {torch.__version__}"
            )
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        # The stream loaded in the generator now. See NOTE [ RNG streams ], rule 4.
        self._active: str | None = None
        self.reset()

    def is_initialized(self) -> bool:
        """True once a stream was added or states were set (False after reset)."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every stream and seed."""
        self._is_initialized = False
        self.states_: dict[str, Any] = {}
        self.seeds_: dict[int, str] = {}

    # The generator's state in this tracker's representation (graph-safe or ByteTensor).
    def _get(self, gen: torch.Generator) -> Any:
        return gen.graphsafe_get_state() if self.use_cudagraphable_rng else gen.get_state()

    def _set(self, gen: torch.Generator, state: Any) -> None:
        if self.use_cudagraphable_rng:
            gen.graphsafe_set_state(self._to_state(state))
        else:
            gen.set_state(self._to_state(state))

    def get_states(self) -> dict[str, Any]:
        """Copies of every stream's state, the active stream's in-flight state included.

        See NOTE [ RNG streams ], rule 5: the caller owns the result; no fork writes into it.
        """
        states = {name: _copy_state(s) for name, s in self.states_.items()}
        if self._active is not None:
            states[self._active] = _copy_state(self._get(device.device_generator()))
        return states

    def set_states(self, states: dict[str, Any]) -> None:
        """Use ``states`` (name -> state, e.g. from get_states) as the tracker's streams.

        megatron-core semantics (NOTE [ RNG streams ], rule 5): the dict itself is kept, not
        copied, and its values are not checked; a later fork stores the advanced state into it.
        Pass a copy to keep the caller's dict unchanged.
        """
        self._is_initialized = True
        self.states_ = states

    def _to_state(self, state: Any) -> Any:
        """``state`` in this tracker's representation (converted only when it is the other one:
        a ByteTensor for a graph-safe tracker, a graph-safe Generator for a plain one)."""
        if self.use_cudagraphable_rng and isinstance(state, torch.Tensor):
            gen = device.device_generator().graphsafe_get_state().clone_state()
            gen.set_state(state)
            return gen
        if not self.use_cudagraphable_rng and isinstance(state, torch.Generator):
            return state.get_state()
        return state

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` seeded with ``seed``; the device generator is left unchanged.

        Raises:
            MegatronCoreError: the seed or the name is already registered.
        """
        if seed in self.seeds_:
            raise MegatronCoreError(
                f"RNG tracker add({name!r}, {seed}): seed {seed} already exists "
                f"(used by stream {self.seeds_[seed]!r})"
            )
        if name in self.states_:
            raise MegatronCoreError(f"RNG tracker add({name!r}, {seed}): stream {name!r} exists")
        self._is_initialized = True
        gen = device.device_generator()
        if self.use_cudagraphable_rng:
            state = gen.graphsafe_get_state().clone_state()
            state.manual_seed(seed)
        else:
            saved = gen.get_state()
            gen.manual_seed(seed)
            state = gen.get_state()
            gen.set_state(saved)
        self.seeds_[seed] = name
        self.states_[name] = state

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; see NOTE [ RNG streams ], rule 4.

        Raises:
            MegatronCoreError: ``name`` was never added.
        """
        if name not in self.states_:
            raise MegatronCoreError(
                f"RNG tracker fork({name!r}): stream {name!r} is not added "
                f"(known: {sorted(self.states_)}); call model_parallel_cuda_manual_seed first"
            )
        gen = device.device_generator()
        outer_name, outer_state = self._active, self._get(gen)
        if outer_name is not None:
            self.states_[outer_name] = outer_state  # See NOTE [ RNG streams ], rule 4
        self._set(gen, self.states_[name])
        self._active = name
        _CPU_DEVICE_STREAM.depth += 1  # a stream is loaded: device_rng() leaves it (rule 6)
        try:
            yield
        finally:
            _CPU_DEVICE_STREAM.depth -= 1
            self.states_[name] = self._get(gen)
            if outer_name is not None:  # the outer stream, advanced by any fork nested in it
                outer_state = self.states_.get(outer_name, outer_state)
            self._set(gen, outer_state)
            self._active = outer_name


class _InferenceMode:
    """No-op add, set_states and fork (megatron-core's inference tracker semantics)."""

    def add(self, name: str, seed: int) -> None:
        """Does nothing: inference draws from the default stream only."""

    def set_states(self, states: Mapping[str, Any]) -> None:
        """Does nothing: the inference tracker holds no streams."""

    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """A null context: no stream is swapped in."""
        return contextlib.nullcontext()


class InferenceCudaRNGStatesTracker(_InferenceMode, CudaRNGStatesTracker):
    """Inference tracker: add, set_states and fork are no-ops (megatron-core semantics)."""


def _te_tracker_class(inference: bool) -> type:
    """Transformer Engine's tracker with value-copy get/set_states; cuda only with a real
    Transformer Engine (the megatron switch's stand-in, whose tracker is this module's, runs on
    any device).

    See NOTE [ RNG streams ], rule 5. A real Transformer Engine is untested here (none in CI).
    """
    try:
        from transformer_engine.pytorch.distributed import CudaRNGStatesTracker as _TETracker
    except ImportError as e:
        raise MegatronCoreError(
            "te_rng_tracker=True needs Transformer Engine (transformer_engine.pytorch), which "
            f"could not be imported: {e}"
        ) from e
    if device.device_type() != "cuda" and not issubclass(_TETracker, CudaRNGStatesTracker):
        raise MegatronCoreError(
            f"te_rng_tracker=True needs Transformer Engine on cuda; device type is "
            f"{device.device_type()!r}"
        )

    class TECudaRNGStatesTracker(_TETracker):
        """Transformer Engine's tracker with megatron-core's is_initialized and copying states."""

        def reset(self):
            super().reset()
            self._is_initialized = False

        def is_initialized(self):
            return self._is_initialized

        def get_states(self):
            return {k: _copy_state(v) for k, v in super().get_states().items()}

        def set_states(self, states):
            super().set_states({k: _copy_state(v) for k, v in states.items()})
            self._is_initialized = True

        def add(self, name, seed):
            super().add(name, seed)
            self._is_initialized = True

    if not inference:
        return TECudaRNGStatesTracker
    return type("InferenceTECudaRNGStatesTracker", (_InferenceMode, TECudaRNGStatesTracker), {})


_CUDA_RNG_STATE_TRACKER: CudaRNGStatesTracker | None = None
_CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Create the global tracker once (again with ``force_reset=True``).

    Args:
        use_te_rng_tracker: use Transformer Engine's tracker (cuda + TE only, else raises).
        inference_rng_tracker: forks are no-ops (:class:`InferenceCudaRNGStatesTracker`).
        use_cudagraphable_rng: graph-safe streams (accelerator only, else raises).
        force_reset: drop the existing tracker and build a new one.
    """
    global _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED
    if force_reset:
        _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED = None, False
    if _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return
    if use_te_rng_tracker:
        tracker = _te_tracker_class(inference_rng_tracker)()
    else:
        cls = InferenceCudaRNGStatesTracker if inference_rng_tracker else CudaRNGStatesTracker
        tracker = cls(use_cudagraphable_rng, is_inference_rng_tracker=inference_rng_tracker)
    _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, True


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> CudaRNGStatesTracker:
    """The global tracker, created with these options on first use."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def get_all_rng_states() -> dict[str, Any]:
    """Copies of every tracker stream's state (megatron-core name; NOTE [ RNG streams ], rule 5)."""
    if not _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        raise MegatronCoreError("get_all_rng_states: the RNG tracker is not initialized")
    return _CUDA_RNG_STATE_TRACKER.get_states()


def _resolve_ranks(tp_rank, ep_rank, etp_rank) -> tuple[int, int, int]:
    """Fill in ranks from parallel_state. The tensor-parallel rank is required (megatron-core
    raises too): before initialize, every TP rank would get the same model-parallel stream.
    The expert ranks default to 0 before initialize."""
    ready = parallel_state.model_parallel_is_initialized()
    if tp_rank is None:
        try:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()  # or the value set
        except MegatronCoreError as exc:
            raise MegatronCoreError(
                "model_parallel_cuda_manual_seed: called before initialize_model_parallel, so "
                "the tensor-parallel rank is unknown and every TP rank would get the same "
                "'model-parallel-rng' stream; call initialize_model_parallel(...) first or pass "
                "tp_rank="
            ) from exc
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank() if ready else 0
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank() if ready else 0
    return tp_rank, ep_rank, etp_rank


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
) -> None:
    """Seed the default generators and register the three streams (NOTE [ RNG streams ], rule 1).

    Seeds the device stream and the CPU generator with ``seed`` (on cpu the device stream is
    then kept apart from the CPU generator: NOTE [ RNG streams ], rule 6), then
    resets the tracker and adds "data-parallel-rng" (seed), "model-parallel-rng"
    (seed + 2718 + tp_rank) and "expert-parallel-rng" (seed + 1024 + 100 * ep_rank + etp_rank).
    Python ``random`` and numpy are not touched. Call after ``initialize_model_parallel``.

    Args:
        seed: the base seed, the same on every rank.
        te_rng_tracker: use Transformer Engine's tracker (cuda + TE only).
        inference_rng_tracker: no-op forks (inference).
        use_cudagraphable_rng: graph-safe streams (accelerator only).
        tp_rank: tensor-parallel rank; default parallel_state's (required before
            initialize_model_parallel: the call raises MegatronCoreError without it).
        ep_rank: expert-parallel rank; default parallel_state's, or 0 before it is initialized.
        etp_rank: expert-tensor-parallel rank; default parallel_state's, or 0 before it is
            initialized.
        force_reset_rng: rebuild the tracker (e.g. to switch between training and inference).
    """
    tp_rank, ep_rank, etp_rank = _resolve_ranks(tp_rank, ep_rank, etp_rank)
    initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    tracker = _CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.default_generator.manual_seed(seed)  # See NOTE [ RNG streams ], rule 6
    device_manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


@dataclass(frozen=True, eq=False)
class RNGSnapshot:
    """Value copies of every generator state checkpointing replays (NOTE [ RNG streams ], rule 5).

    Attributes:
        device_type: the device type when taken; restoring under another one raises.
        cpu_state: the CPU generator's state.
        device_state: the device stream's state (NOTE [ RNG streams ], rule 6; the CPU
            generator's state on cpu before the stream is kept apart or inside a fork).
        tracker_states: read-only mapping, tracker stream name -> state copy.
        active_stream: the stream whose fork was active when taken (None outside any fork).
    """

    device_type: str
    cpu_state: torch.Tensor
    device_state: torch.Tensor
    tracker_states: Mapping[str, Any]
    active_stream: str | None = None


def get_rng_snapshot() -> RNGSnapshot:
    """Copy the CPU, device and tracker-stream states (the tracker is created if needed)."""
    kind = device.device_type()
    tracker = get_cuda_rng_tracker()
    states = types.MappingProxyType(tracker.get_states())
    cpu_state, device_state = get_generator_states()
    return RNGSnapshot(kind, cpu_state, device_state, states, getattr(tracker, "_active", None))


def set_rng_snapshot(snapshot: RNGSnapshot) -> None:
    """Restore every state in ``snapshot``; the snapshot is copied, never aliased (reusable).

    Raises:
        MegatronCoreError: the snapshot was taken under another device type.
    """
    kind = device.device_type()
    if snapshot.device_type != kind:
        raise MegatronCoreError(
            f"set_rng_snapshot: snapshot was taken on {snapshot.device_type!r}, "
            f"device type is now {kind!r}"
        )
    tracker = get_cuda_rng_tracker()
    # A fresh copy: set_states keeps the dict it is given. See NOTE [ RNG streams ], rule 5
    tracker.set_states({name: _copy_state(s) for name, s in snapshot.tracker_states.items()})
    if hasattr(tracker, "_active"):  # See NOTE [ RNG streams ], rule 5
        tracker._active = snapshot.active_stream
    # The active stream first: it decides where the device stream lives (rule 6).
    set_generator_states(snapshot.cpu_state, snapshot.device_state)


class _CpuDeviceStream:
    """NOTE [ RNG streams ], rule 6: on cpu, the state CUDA's default generator would hold.

    ``state`` is None until the stream is seeded (draws then come from the CPU generator, as
    before); ``depth`` counts the blocks that have a stream loaded in the CPU generator now: the
    :func:`device_rng` blocks and the forks of every tracker (the global one or a user's own).
    """

    __slots__ = ("state", "depth")

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.depth = 0


_CPU_DEVICE_STREAM = _CpuDeviceStream()


def _stream_loaded() -> bool:
    """True when a stream is loaded in the CPU generator now: inside a fork or a device_rng
    block, or with the global tracker's active stream restored by a snapshot (a recompute)."""
    active = getattr(_CUDA_RNG_STATE_TRACKER, "_active", None)
    return bool(_CPU_DEVICE_STREAM.depth) or active is not None


def renew_stream_tensors() -> None:
    """Replace every ByteTensor that holds a stream's state now (the global tracker's streams,
    the CPU device stream) with a copy of the same value: the streams draw exactly as before;
    only the tensors are new. The CPU allocator timeline calls it inside its profiler session
    before it begins counting, so that the frees a fork makes of these blocks during the step
    count (it leaves out the frees of blocks allocated before its session: NOTE [ Frees the CPU
    profiler records ], rule 4, in parallel_state/handed.py)."""
    tracker = _CUDA_RNG_STATE_TRACKER
    if tracker is not None and getattr(tracker, "_active", None) is None:
        states = getattr(tracker, "states_", None)
        if isinstance(states, dict):
            for name, state in list(states.items()):
                if isinstance(state, torch.Tensor):
                    states[name] = state.clone()
    if isinstance(_CPU_DEVICE_STREAM.state, torch.Tensor):
        _CPU_DEVICE_STREAM.state = _CPU_DEVICE_STREAM.state.clone()


def _device_stream_apart() -> bool:
    """True on cpu when the device stream is held apart from the CPU generator right now (it is
    seeded, and no stream is loaded in the CPU generator)."""
    if _CPU_DEVICE_STREAM.state is None or device.device_type() != "cpu":
        return False
    return not _stream_loaded()


@contextlib.contextmanager
def device_rng() -> Iterator[None]:
    """Draws inside the block come from the device stream (NOTE [ RNG streams ], rule 6).

    On cpu, with the device stream kept apart, loads it into the CPU generator for the block and
    stores the advanced state back on exit (also when the body raises); host draws outside the
    block never move it. On cuda, before the stream is seeded, or inside a fork (which has its
    own stream loaded), it does nothing: the draws already come from the right generator.
    """
    if not _device_stream_apart():
        yield
        return
    stream, gen = _CPU_DEVICE_STREAM, torch.default_generator
    host = gen.get_state()
    gen.set_state(stream.state)
    stream.depth += 1
    try:
        yield
    finally:
        stream.depth -= 1
        stream.state = gen.get_state()
        gen.set_state(host)


def get_device_rng_state() -> torch.Tensor:
    """A copy of the device stream's state: the current GPU generator's on cuda; on cpu the
    stream kept apart (NOTE [ RNG streams ], rule 6), else the CPU generator's."""
    if _device_stream_apart():
        return _CPU_DEVICE_STREAM.state.clone()
    return device.get_rng_state()


def get_generator_states() -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of (the CPU generator's state, the device stream's state), as a snapshot holds
    them: one tensor twice on cpu while the two are one generator, so it is held and restored
    once (NOTE [ RNG streams ], rule 6)."""
    cpu_state = torch.get_rng_state()
    if device.device_type() == "cpu" and not _device_stream_apart():
        return cpu_state, cpu_state
    return cpu_state, get_device_rng_state()


def set_generator_states(cpu_state: torch.Tensor, device_state: torch.Tensor) -> None:
    """Restore what :func:`get_generator_states` returned. Restore the tracker's active stream
    first: it decides where the device stream lives (rule 6)."""
    torch.set_rng_state(cpu_state)  # set_state copies the tensor in
    if device_state is not cpu_state:
        set_device_rng_state(device_state)


def set_device_rng_state(state: torch.Tensor) -> None:
    """Set the device stream's state from ``state`` (as returned by get_device_rng_state)."""
    if _device_stream_apart():
        _CPU_DEVICE_STREAM.state = torch.as_tensor(state, dtype=torch.uint8).clone()
    else:
        device.set_rng_state(state)


def device_manual_seed(seed: int) -> None:
    """Seed the device stream with ``seed``: the current GPU's generator on cuda; on cpu the
    stream kept apart from the CPU generator from now on (NOTE [ RNG streams ], rule 6), or the
    stream a fork has loaded. The CPU generator's host draws are not touched."""
    if device.device_type() != "cpu":
        device.manual_seed(seed)
        return
    if _stream_loaded():
        torch.default_generator.manual_seed(int(seed))
        return
    gen = torch.Generator()
    gen.manual_seed(int(seed))
    _CPU_DEVICE_STREAM.state = gen.get_state()


def keep_device_stream_apart(enabled: bool) -> None:
    """Start (from the CPU generator's current state) or stop keeping the cpu device stream
    apart (NOTE [ RNG streams ], rule 6). The switch's CPU mode starts it; a test harness stops
    it between tasks. Starting an already kept stream changes nothing."""
    stream = _CPU_DEVICE_STREAM
    if not enabled:
        stream.state = None
    elif stream.state is None:
        stream.state = torch.default_generator.get_state()
