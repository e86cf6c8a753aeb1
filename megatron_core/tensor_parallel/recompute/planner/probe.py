"""Measuring what a recompute plan needs, on the user's own model and layout: the allocator's
bytes between marks of one training step (:class:`MemoryTimeline`), the marks a
:class:`~megatron_core.transformer.TransformerBlock` sets around each layer
(:class:`LayerMarks`), and the bytes of the model states (:func:`model_state_bytes`).

The model that turns these measurements into a prediction, and the search, are in search.py
(NOTE [ Recompute planner ] in the planner's face).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import NamedTuple

import torch

from megatron_core import compat, device
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.handed import recording_frees
from megatron_core.tensor_parallel.recompute.memory import storage_key_and_nbytes
from megatron_core.tensor_parallel.recompute.planner.megatron import (
    MegatronCoreBlock,
    is_megatron_core_block,
)

__all__ = [
    "MemoryTimeline",
    "LayerMarks",
    "Probe",
    "model_state_bytes",
    "gradient_bytes",
    "pending_optimizer_state_bytes",
    "probe_step",
    "step_peak",
    "step_total_peak",
    "time_step",
]

_MARK = "megatron_core.recompute_plan:"
_BEGIN = _MARK + "<begin>"  # where a CPU timeline's counting begins (not among its points)


class MemoryTimeline:
    """Bytes allocated on this rank's device while a block runs, read at named marks.

    After the block, :attr:`points` holds for every :meth:`mark`, in order,
    ``(name, live, peak)``: the bytes allocated at the mark and the most allocated since the
    previous mark (or the block's start), both counted from what was allocated when the block
    began. On CUDA they are ``device.memory_allocated`` / ``max_memory_allocated`` read at
    each mark after a synchronize (the peak statistic is reset at each mark). On the CPU, which
    keeps no such counter, torch's profiler records every allocation and free with its time
    (``profile_memory=True``); each mark is a ``record_function`` range, and the allocations are
    replayed in time order up to each mark; while it records, the package's collectives keep
    gloo's worker thread from freeing their tensors unseen (NOTE [ Frees the CPU profiler
    records ], in parallel_state/handed.py). Marks must come from the thread that runs
    the step (autograd runs a CPU backward, and its tensor hooks, on the caller's thread). On
    the CPU only the blocks allocated inside the timeline count: the free of an older block is
    left out (the profiler's size for it can be another block's, rule 4 of that NOTE), so begin
    where nothing older is freed inside that matters (drop the gradients first); the RNG
    streams' state tensors, which a fork replaces, are re-created as the timeline begins, so
    that their frees count as on CUDA.

    With ``total``, :attr:`start_total` is the allocator's total as the block began, nothing
    subtracted (``device.allocated_bytes``: on CUDA ``memory_allocated``, on the CPU the census
    of NOTE [ The allocator's total on the CPU ] in device.py), so that ``start_total`` plus a
    point's peak is the total at that peak (on CUDA exactly ``max_memory_allocated``), the
    garbage in reference cycles collected first.
    """

    def __init__(self, total: bool = False) -> None:
        self.cuda = device.device_type() == "cuda"
        self.points: list[tuple[str, int, int]] = []
        self.total = total
        self.start_total = 0
        self._profiler = None
        self._base = 0

    def __enter__(self) -> MemoryTimeline:
        if self.total:
            # tensors in reference cycles that the collector has not reached yet are still
            # allocated, and when it reaches them depends on what every thread allocated so
            # far: a census with them counts a transient that the next step may not see
            gc.collect()
        if self.cuda:
            device.synchronize()
            self._base = self.start_total = device.memory_allocated()
            device.reset_peak_memory_stats()
        else:
            self.start_total = device.allocated_bytes() if self.total else 0
            from megatron_core.tensor_parallel.random import renew_stream_tensors

            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self._frees = recording_frees()  # NOTE [ Frees the CPU profiler records ]
            self._frees.__enter__()
            self._profiler.__enter__()
            renew_stream_tensors()  # rule 4 there: blocks of this session, same values
            with torch.profiler.record_function(_BEGIN):
                pass
        return self

    def mark(self, name: str) -> None:
        """Record the allocator's state now under ``name``."""
        if self.cuda:
            device.synchronize()
            live = device.memory_allocated() - self._base
            peak = device.max_memory_allocated() - self._base
            device.reset_peak_memory_stats()
            self.points.append((name, live, peak))
        else:
            with torch.profiler.record_function(_MARK + name):
                pass

    def __exit__(self, *exc) -> None:
        if self.cuda:
            return
        self._profiler.__exit__(*exc)
        self._frees.__exit__(*exc)
        if exc[0] is not None:
            return
        allocations, marks = compat.profiler_allocations(self._profiler, _MARK)
        blocks: dict[int, int] = {}  # address -> bytes of the blocks allocated in the session
        live = peak = base = 0
        index = 0
        for at, name in marks:
            while index < len(allocations) and allocations[index][0] <= at:
                _, nbytes, kind, address = allocations[index]
                index += 1
                if kind != "cpu":
                    continue
                if nbytes > 0:
                    blocks[address] = nbytes
                elif address in blocks:
                    nbytes = -blocks.pop(address)
                else:  # older than the session: its size is not known (rule 4)
                    continue
                live += nbytes
                peak = max(peak, live)
            if name == _BEGIN:
                base = peak = live
            else:
                self.points.append((name[len(_MARK) :], live - base, peak - base))
                peak = live

    def as_dict(self) -> dict[str, tuple[int, int]]:
        """``{name: (live, peak)}`` of :attr:`points`."""
        return {name: (live, peak) for name, live, peak in self.points}


class LayerMarks:
    """The marks a TransformerBlock sets while it is ``probe``'d (``block.probe = marks``,
    with ``block.set_layer_recompute``): ``f{i}`` after layer i's forward; ``g{i}`` when the
    gradient of layer i's output is complete (layer i's backward begins; for the last layer,
    the head's backward has ended); ``g-1`` when the gradient of layer 0's input is complete
    (layer 0's backward has ended)."""

    def __init__(self, timeline: MemoryTimeline) -> None:
        self.timeline = timeline
        self.shape: tuple[int, ...] | None = None  # layer 0's input shape
        self.prefix = ""  # before every mark's name: "2:" in a probe's second microbatch

    def layer_input(self, index: int, hidden: torch.Tensor) -> None:
        """Before layer ``index`` runs on ``hidden``."""
        if index == 0:
            self.shape = tuple(hidden.shape)
        if index == 0 and hidden.requires_grad:
            hidden.register_hook(self._hook(self.prefix + "g-1"))

    def layer_output(self, index: int, hidden: torch.Tensor) -> None:
        """After layer ``index`` returned ``hidden``."""
        self.timeline.mark(f"{self.prefix}f{index}")
        if hidden.requires_grad:
            self.output_gradient(index, hidden)

    def output_gradient(self, index: int, output: torch.Tensor) -> None:
        """Mark ``g{index}`` when ``output`` (layer ``index``'s output) has its gradient."""
        output.register_hook(self._hook(f"{self.prefix}g{index}"))

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.timeline.mark(name)

        return hook


def _optimizers(optimizer) -> list:
    """``optimizer`` and every optimizer inside it: the one a wrapper holds (``.optimizer``, as a
    mixed-precision wrapper or megatron-core's MegatronOptimizer does) and those a chain holds
    (megatron-core's ChainedOptimizer, ``.chained_optimizers``), each once."""
    found, todo = [], [optimizer]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        todo += list(getattr(current, "chained_optimizers", None) or [])
        todo.append(getattr(current, "optimizer", None))
    return found


def _state_dicts(optimizer) -> list:
    """The per-parameter state dicts of one optimizer object (a torch optimizer's ``state``; a
    wrapper's view of its inner optimizers' state, megatron-core's ProxyDict, is skipped: the
    inner optimizers are counted themselves)."""
    state = getattr(optimizer, "state", None)
    return list(state.values()) if isinstance(state, dict) else []


def model_state_bytes(model: torch.nn.Module, optimizer=None) -> int:
    """Bytes of this rank's model states, each storage once: the parameters and their
    gradients (``.grad``, and ``.main_grad`` where present: megatron-core DDP's buffers), and
    for ``optimizer`` and every optimizer inside it (:func:`_optimizers`) the parameters of its
    groups (fp32 main weights, a distributed optimizer's shards) with their gradients, and its
    state tensors (Adam's moments). Counted from the objects, not estimated: an optimizer that
    has not stepped yet has no state to count."""
    seen: dict = {}

    def add(tensor) -> None:
        if isinstance(tensor, torch.Tensor):
            key, nbytes = storage_key_and_nbytes(tensor)
            seen[key if key is not None else ("unkeyed", id(tensor))] = nbytes

    def add_param(param) -> None:
        add(param)
        add(param.grad)
        add(getattr(param, "main_grad", None))

    for param in model.parameters():
        add_param(param)
    for inner in _optimizers(optimizer):
        for group in getattr(inner, "param_groups", None) or []:
            for param in group["params"]:
                add_param(param)
        for state in _state_dicts(inner):
            for value in state.values():
                add(value)
    return sum(seen.values())


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the ``.grad`` tensors a backward creates: the parameters that require one and
    accumulate into neither an existing ``.grad`` nor a ``main_grad`` buffer (those count as
    model states)."""
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if p.requires_grad and p.grad is None and getattr(p, "main_grad", None) is None
    )


def pending_optimizer_state_bytes(optimizer) -> int:
    """Bytes the optimizer's states will take at its first step, where it has none yet (0 once
    it has): for each innermost optimizer (:func:`_optimizers`: the torch optimizers of a
    wrapper or a chain), Adam / AdamW two moments per parameter of its groups, SGD with momentum
    one; the rest is assumed Adam-like (two). Lets a plan made before the first step count
    them."""
    total = 0
    for inner in _optimizers(optimizer):
        if getattr(inner, "optimizer", None) is not None or getattr(
            inner, "chained_optimizers", None
        ):
            continue  # a wrapper or a chain: its inner optimizers hold the states
        if _state_dicts(inner):
            continue
        per_param = 2
        if isinstance(inner, torch.optim.SGD):
            per_param = 1 if any(g.get("momentum", 0) for g in inner.param_groups) else 0
        for group in getattr(inner, "param_groups", None) or []:
            for param in group["params"]:
                total += per_param * param.numel() * param.element_size()
    return total


def _find_blocks(model: torch.nn.Module) -> list:
    """The model's layer stack: the one submodule with ``set_layer_recompute`` and ``probe``
    (megatron_core.transformer's TransformerBlock; found by what it offers, so this module does
    not import the transformer family above it), or megatron-core's own TransformerBlock, seen
    through :class:`~megatron_core.tensor_parallel.recompute.planner.megatron.MegatronCoreBlock`."""
    blocks = []
    for module in model.modules():
        if is_megatron_core_block(module):
            blocks.append(MegatronCoreBlock.of(module))
        elif hasattr(module, "set_layer_recompute") and hasattr(module, "probe"):
            blocks.append(module)
    if len(blocks) != 1:
        raise MegatronCoreError(
            "recompute planner: the model must hold one TransformerBlock (ours, with "
            f"set_layer_recompute, or megatron-core's), it holds {len(blocks)}"
        )
    return blocks


class Probe(NamedTuple):
    """A probe step's allocator marks ``{name: (live, peak)}`` (:class:`MemoryTimeline`) and
    layer 0's input shape."""

    points: dict[str, tuple[int, int]]
    shape: tuple[int, ...] | None

    @property
    def peak(self) -> int:
        """The most bytes allocated during the step, above what was allocated before it."""
        return max(peak for _, peak in self.points.values())

    @property
    def left(self) -> int:
        """What the step left allocated once its gradients were dropped, above what was
        allocated before it: buffers the model or its libraries made in the step and keep
        (megatron-core's global memory buffer at a first forward); 0 for a step like the last."""
        return self.points["left"][0]


def probe_step(
    model: torch.nn.Module,
    choices: list[str],
    forward: Callable[[], torch.Tensor],
    microbatches: int = 1,
) -> Probe:
    """One forward + backward of ``forward()`` (which returns the scalar loss) per microbatch,
    the gradients accumulating, with the layers' recompute set to ``choices``; the allocator's
    marks (:class:`MemoryTimeline`, :class:`LayerMarks`) plus ``head`` (after the loss) and
    ``end`` (after backward), those of microbatch n > 1 named with the prefix ``"{n}:"``, and
    ``left`` after the gradients are dropped (``set_to_none``; :attr:`Probe.left`)."""
    (block,) = _find_blocks(model)
    block.set_layer_recompute(choices)
    model.zero_grad(set_to_none=True)
    timeline = MemoryTimeline()
    block.probe = marks = LayerMarks(timeline)
    try:
        with timeline:
            for index in range(microbatches):
                marks.prefix = f"{index + 1}:" if index else ""
                loss = forward()
                timeline.mark(marks.prefix + "head")
                loss.backward()
                timeline.mark(marks.prefix + "end")
                del loss
            model.zero_grad(set_to_none=True)
            timeline.mark("left")
    finally:
        block.probe = None
        model.zero_grad(set_to_none=True)
    return Probe(timeline.as_dict(), marks.shape)


def step_peak(modules, step: Callable[[], object]) -> int:
    """The most bytes allocated while ``step()`` runs (forwards and backwards of a training
    step, a pipeline schedule's included), above what was allocated as it began
    (:class:`MemoryTimeline`). The gradients of ``modules`` (a module, or a list of a rank's
    model chunks) are dropped before the step (the timeline must see no older frees) and after."""
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    for module in modules:
        module.zero_grad(set_to_none=True)
    timeline = MemoryTimeline()
    with timeline:
        step()
        timeline.mark("end")
    for module in modules:
        module.zero_grad(set_to_none=True)
    return max(peak for _, _, peak in timeline.points)


def step_total_peak(modules, step: Callable[[], object]) -> int:
    """The allocator's total at the peak of ``step()``, nothing subtracted: model states,
    optimizer states, every buffer alive, and the step's own peak (``max_memory_allocated``
    after a reset on CUDA; on the CPU the census as the step begins plus the allocator events'
    peak above it: :class:`MemoryTimeline` with ``total``). The gradients of ``modules`` are
    dropped before the step and after, as :func:`step_peak` does."""
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    for module in modules:
        module.zero_grad(set_to_none=True)
    timeline = MemoryTimeline(total=True)
    with timeline:
        step()
        timeline.mark("end")
    for module in modules:
        module.zero_grad(set_to_none=True)
    return timeline.start_total + max(peak for _, _, peak in timeline.points)


def time_step(
    model: torch.nn.Module, choices: list[str], forward: Callable[[], torch.Tensor], repeats: int
) -> float:
    """Median milliseconds of ``repeats`` forward + backward steps with the layers' recompute
    set to ``choices``: the work of the step on this rank (``device.StepTimer``: CUDA events on
    a GPU, this thread's CPU time on the CPU), which other processes on the machine do not move
    (NOTE [ Recompute planner ], rule 2)."""
    (block,) = _find_blocks(model)
    block.set_layer_recompute(choices)
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        with device.StepTimer() as timer:
            forward().backward()
        times.append(timer.ms)
    model.zero_grad(set_to_none=True)
    times.sort()
    return times[len(times) // 2]
