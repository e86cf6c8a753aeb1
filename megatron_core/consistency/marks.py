"""Where iterations begin and where the digest is compared (NOTE [ Check window ] in switch.py,
rules 1 and 5).

* :func:`iteration`, a block: the schedules wrap each ``forward_backward_func`` call in it, the
  main job its step. It begins an iteration; the digest is compared when the outermost block
  ends, or at the first optimizer step inside it (the main job steps inside its block).
* :func:`note_iteration`: a function that runs once a step, outside any block --
  ``finalize_model_grads``, or a torch optimizer's ``step`` (a global pre-step hook, so the
  digest is compared before the step applies anything).
* :func:`backward_mark`: the first package collective outside any backward after one inside a
  backward, in a loop with no stronger mark (checks.py calls it when switch.decide says so).

Each counted mark outside a block compares the digest of the iteration it ends, then begins the
next. Every rank must mark the same iterations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_core.consistency import digest, switch
from megatron_core.errors import MegatronCoreError

__all__ = ["iteration", "note_iteration", "backward_mark", "compare_now"]

_PLACES = {
    "block": "at the end of iteration {n}",
    "step": "before the optimizer step of iteration {n}",
    "finalize": "at finalize_model_grads of iteration {n}",
    "optimizer": "before the optimizer step of iteration {n}",
    "backward": "at the first collective after the backward of iteration {n}",
}


def compare_now(place: str = "block", head=None) -> None:
    """Compare the digest of every group that has one (rule 5), in the default mode only;
    ``place`` names where in the iteration, for the message; ``head``: see digest.compare.
    Every rank must call it alike."""
    if switch.mode() is not switch.CheckMode.WINDOW:
        return
    state = switch.window()
    groups = switch.take_digested()
    if groups:  # a block's mark began its iteration; the others end theirs (before counting)
        number = state.marks + (0 if place in ("block", "step") else 1)
        digest.compare(groups, _PLACES[place].format(n=number), state.marks, head)


@contextlib.contextmanager
def iteration(kind: str = "train") -> Iterator[None]:
    """Mark the block as one iteration of ``kind`` ("train" or "eval") for the check window
    (NOTE [ Check window ], rule 1); a block inside another counts nothing. After the window,
    the outermost block's end (or the first optimizer step inside it) compares the digest
    (rule 5): it raises there, on every rank of a group whose collectives differed. Every rank
    must mark the same iterations."""
    if kind not in ("train", "eval"):
        raise MegatronCoreError(f"iteration: kind ({kind!r}) must be 'train' or 'eval'")
    outermost = switch.window().depth == 0
    if outermost and switch.counts("block"):
        switch.mark("block", kind)
    state = switch.window()  # the mark may have started a new count (rule 1)
    if outermost:
        state.compared = False
    state.depth += 1
    finished = False
    try:
        yield
        finished = True
    finally:
        state = switch.window()  # the current state: a restart inside the block keeps the depth
        state.depth -= 1
        if outermost and not finished:
            digest.discard()  # the ranks that raised alike begin the next iteration alike
    if outermost and not state.compared and state.strongest == switch.SOURCES["block"]:
        compare_now("block")


def note_iteration(source: str = "finalize") -> None:
    """A training iteration seen by a function that runs once a step (``"finalize"``:
    ``finalize_model_grads``; ``"optimizer"``: a torch optimizer's step): counts outside
    :func:`iteration` blocks, while no stronger kind of mark has been seen (rule 1); a counted
    mark first compares the digest of the iteration it ends (rule 5)."""
    if source not in ("finalize", "optimizer"):
        raise MegatronCoreError(f"note_iteration: source ({source!r}) is not finalize/optimizer")
    _outside_blocks(source)


def backward_mark(head=None) -> None:
    """Rule 1's weakest mark, when switch.decide found it due: compare, then begin the next.
    ``head``: (group name, digest.Head) of the collective that found it due, when its group is
    closed: agreed in that group's digest exchange, and no head of its own afterwards."""
    _outside_blocks("backward", head)
    if head is not None:
        switch.window().heads.discard(head[0])


def _outside_blocks(source: str, head=None) -> None:
    state = switch.window()
    if state.depth == 0 and switch.counts(source):
        compare_now(source, head)
        switch.mark(source, "train")


def _optimizer_stepping(optimizer, args, kwargs) -> None:
    """torch's global pre-step hook: inside a block, the block's digest (once); outside, a
    once-a-step mark of the optimizer's kind (rule 1)."""
    state = switch.window()
    if state.depth == 0:
        _outside_blocks("optimizer")
    elif not state.compared and state.strongest == switch.SOURCES["block"]:
        state.compared = True
        compare_now("step")


register_optimizer_step_pre_hook(_optimizer_stepping)
