"""RNG stream audit across ranks, and per-rank RNG state save/load for exact resume.

Both build on the tracker and snapshots in ``tensor_parallel/random.py``; the rules they enforce
are NOTE [ RNG streams ] in that file.
"""

from __future__ import annotations

import random as _py_random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel._collectives import _all_gather_single
from megatron_core.tensor_parallel.random import (
    _DATA_PARALLEL_RNG_TRACKER_NAME,
    _EXPERT_PARALLEL_RNG_TRACKER_NAME,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    RNGSnapshot,
    device_rng,
    get_cuda_rng_tracker,
    get_rng_snapshot,
    set_rng_snapshot,
)

__all__ = ["RNGAuditReport", "audit_rng_streams", "get_rng_state_dict", "set_rng_state_dict"]

_DEFAULT = "default"
_STREAMS = (
    _DEFAULT,
    _DATA_PARALLEL_RNG_TRACKER_NAME,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    _EXPERT_PARALLEL_RNG_TRACKER_NAME,
)
# See NOTE [ RNG streams ], rule 3: (group kind, stream, must be "equal" or "distinct", rule).
_RULES = (
    ("tp", _DEFAULT, "equal", "3a"),
    ("tp", _DATA_PARALLEL_RNG_TRACKER_NAME, "equal", "3a"),
    ("tp", _MODEL_PARALLEL_RNG_TRACKER_NAME, "distinct", "3b"),
    ("dp", _MODEL_PARALLEL_RNG_TRACKER_NAME, "equal", "3b"),
    ("tp-ep", _EXPERT_PARALLEL_RNG_TRACKER_NAME, "distinct", "3c"),
    ("dp-modulo-ep", _EXPERT_PARALLEL_RNG_TRACKER_NAME, "equal", "3c"),
)
_GROUP_KINDS = ("tp", "dp", "tp-ep", "dp-modulo-ep")  # gathered in this order on every rank


@dataclass(frozen=True)
class RNGAuditReport:
    """What :func:`audit_rng_streams` saw on this rank.

    Attributes:
        global_rank: this rank.
        draws: stream -> the numbers this rank drew from it (NaN: stream not registered).
        passed: the rules that held for this rank's groups, one line each.
        violations: the rules broken in this rank's groups, one line each.
        total_violations: violations summed over all ranks (every rank gets the same number).
    """

    global_rank: int
    draws: dict[str, tuple[float, ...]]
    passed: tuple[str, ...]
    violations: tuple[str, ...]
    total_violations: int

    @property
    def ok(self) -> bool:
        """True when no rank found a violation."""
        return self.total_violations == 0


def _draw_all(num_draws: int) -> torch.Tensor:
    """[len(_STREAMS), num_draws] float64 draws, NaN rows for missing streams; no state changes."""
    tracker = get_cuda_rng_tracker()
    was_initialized = tracker.is_initialized()
    rows = torch.full((len(_STREAMS), num_draws), float("nan"), dtype=torch.float64)
    dev = device.current_device()
    snapshot = get_rng_snapshot()
    try:
        with device_rng():  # the default stream is the device stream (NOTE rule 6)
            rows[0] = torch.rand(num_draws, dtype=torch.float64, device=dev).cpu()
        for i, name in enumerate(_STREAMS[1:], start=1):
            if name in tracker.states_:
                with tracker.fork(name):
                    rows[i] = torch.rand(num_draws, dtype=torch.float64, device=dev).cpu()
    finally:
        set_rng_snapshot(snapshot)
        if not was_initialized:
            tracker.reset()  # set_states marks the tracker initialized; an empty one was not
    return rows.to(dev)


def _check(kind, stream, must, rule, ranks, gathered) -> str | None:
    """None if the rule holds for this group, else a message naming the ranks."""
    i = _STREAMS.index(stream)
    rows = [tuple(gathered[r, i].tolist()) for r in range(len(ranks))]
    missing = [ranks[r] for r, row in enumerate(rows) if row[0] != row[0]]  # NaN
    where = f"{stream!r} must be {must.upper()} across the {kind} group {ranks} (rule {rule})"
    if missing:
        return f"{where}, but global rank(s) {missing} have no {stream!r} stream"
    if must == "equal":
        odd = [ranks[r] for r, row in enumerate(rows) if row != rows[0]]
        return f"{where}, but global rank(s) {odd} differ from rank {ranks[0]}" if odd else None
    seen: dict[tuple, int] = {}
    for r, row in enumerate(rows):
        if row in seen:
            return f"{where}, but global ranks {seen[row]} and {ranks[r]} draw the same numbers"
        seen[row] = ranks[r]
    return None


def audit_rng_streams(raise_on_violation: bool = True, num_draws: int = 4) -> RNGAuditReport:
    """Check NOTE [ RNG streams ], rule 3 across ranks, leaving every RNG state as it was.

    Each rank draws ``num_draws`` numbers from the default stream and from every tracker stream
    (inside a snapshot that is restored afterwards), gathers them over the tensor, data,
    tensor x expert and data-modulo-expert groups, and checks the rules. Every rank runs the same
    collectives in the same order, then all ranks agree on the total count, so either every rank
    raises or none does. Call it on every rank, outside any fork, after seeding or loading.

    Args:
        raise_on_violation: raise MegatronCoreError if any rank found a violation.
        num_draws: numbers drawn per stream (more makes a chance collision less likely).

    Returns:
        This rank's report.

    Raises:
        MegatronCoreError: parallel_state is not initialized, the call is inside a fork, or (with
            ``raise_on_violation``) a rule is broken on some rank.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise MegatronCoreError(
            "audit_rng_streams needs parallel_state: call initialize_model_parallel(...) first"
        )
    active = getattr(get_cuda_rng_tracker(), "_active", None)  # TE's tracker has none
    if active is not None:
        raise MegatronCoreError(
            f"audit_rng_streams called inside fork({active!r}); call it outside any fork"
        )
    state = parallel_state.get_parallel_state()
    local = _draw_all(num_draws)
    passed, violations = [], []
    for kind in _GROUP_KINDS:
        ranks = state.ranks[kind]
        gathered = local.new_empty(len(ranks) * local.numel())
        _all_gather_single(gathered, local.flatten(), group=state.group(kind))
        gathered = gathered.view(len(ranks), *local.shape).cpu()
        for rule in (r for r in _RULES if r[0] == kind):
            message = _check(*rule, ranks, gathered)
            if message is None:
                passed.append(f"{rule[1]!r} {rule[2]} across the {kind} group {ranks}: ok")
            else:
                violations.append(message)
    total = torch.tensor([len(violations)], dtype=torch.int64, device=local.device)
    dist.all_reduce(total)
    report = RNGAuditReport(
        global_rank=state.global_rank,
        draws={name: tuple(local[i].tolist()) for i, name in enumerate(_STREAMS)},
        passed=tuple(passed),
        violations=tuple(violations),
        total_violations=int(total.item()),
    )
    if raise_on_violation and not report.ok:
        mine = "\n  ".join(violations) or "(none in this rank's groups)"
        raise MegatronCoreError(
            f"RNG stream audit failed: {report.total_violations} violation(s) over all ranks; "
            f"on global rank {state.global_rank}:\n  {mine}"
        )
    return report


# --- save / load ------------------------------------------------------------------------------

_STATE_DICT_VERSION = 1
_LAYOUT_KINDS = ("tp", "pp", "dp", "cp", "ep")


def _layout() -> dict[str, int | None]:
    """World size, global rank and every parallel rank/size of this process (None if unknown)."""
    ready = dist.is_available() and dist.is_initialized()
    layout: dict[str, int | None] = {
        "world_size": dist.get_world_size() if ready else 1,
        "global_rank": dist.get_rank() if ready else 0,
    }
    state = (
        parallel_state.get_parallel_state()
        if parallel_state.model_parallel_is_initialized()
        else None
    )
    for kind in _LAYOUT_KINDS:
        layout[f"{kind}_rank"] = state.rank_in(kind) if state else None
        layout[f"{kind}_size"] = state.size_of(kind) if state else None
    return layout


def _as_tensor(state: Any) -> torch.Tensor:
    return state.get_state() if isinstance(state, torch.Generator) else state.clone()


def get_rng_state_dict() -> dict[str, Any]:
    """This rank's RNG state for an exact resume, in a form ``torch.save`` writes.

    Covers python ``random``, the CPU generator, the device generator and every tracker stream,
    plus the rank layout it was taken under (world size, global rank, tp/pp/dp/cp/ep rank and
    size) so that :func:`set_rng_state_dict` can refuse another rank's state. numpy is not
    included. Save one per rank.
    """
    snapshot = get_rng_snapshot()
    return {
        "version": _STATE_DICT_VERSION,
        "layout": _layout(),
        "device_type": snapshot.device_type,
        "python": _py_random.getstate(),
        "cpu": snapshot.cpu_state,
        "device": snapshot.device_state,
        "tracker": {name: _as_tensor(s) for name, s in snapshot.tracker_states.items()},
    }


def set_rng_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state_dict` saved, after checking it belongs to this rank.

    Raises:
        MegatronCoreError: unknown version, another device type, or another rank layout; the
            message names every mismatching field with its saved and current value. Nothing is
            restored in that case.
    """
    version = state_dict.get("version")
    if version != _STATE_DICT_VERSION:
        raise MegatronCoreError(
            f"RNG state dict version ({version!r}) is not {_STATE_DICT_VERSION}: not written by "
            "get_rng_state_dict"
        )
    current, saved = _layout(), state_dict["layout"]
    wrong = [
        f"{k} (saved {saved.get(k)}, now {v})" for k, v in current.items() if saved.get(k) != v
    ]
    if wrong:
        raise MegatronCoreError(
            f"RNG state dict was saved under another rank layout: {', '.join(wrong)}; loading it "
            "would restore another rank's RNG streams"
        )
    snapshot = RNGSnapshot(
        state_dict["device_type"], state_dict["cpu"], state_dict["device"], state_dict["tracker"]
    )
    set_rng_snapshot(snapshot)  # checks the device type before it restores anything
    _py_random.setstate(state_dict["python"])
