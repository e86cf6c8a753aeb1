"""Posting and waiting for the p2p operations of one exchange (NOTE [ P2P matching ] in
p2p_communication.py): operation order, tags, request handles, the shape pre-exchange."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core.errors import MegatronCoreError

# NOTE [ P2P matching ], rule 2: one tag per kind of message, so that an activation never
# matches a gradient's receive, nor a shape (rule 5) a tensor's.
TAGS = {"send_next": 0, "recv_prev": 0, "send_prev": 1, "recv_next": 1}
SHAPE_TAGS = {"send_next": 2, "recv_prev": 2, "send_prev": 3, "recv_next": 3}
_EVEN_ORDER = ("send_next", "recv_prev", "send_prev", "recv_next")
_ODD_ORDER = ("recv_prev", "send_next", "recv_next", "send_prev")


class Request:
    """One posted operation: ``wait()`` waits (once), bounded by the timeout, and keeps the
    tensor alive until then (a sent output may be deallocated by the schedule meanwhile)."""

    def __init__(
        self,
        work,
        peer: str,
        timeout: datetime.timedelta | None,
        tensor=None,
        staged=None,
        receive: bool = False,
    ):
        self.work, self.peer, self.timeout, self.tensor = work, peer, timeout, tensor
        # The host copy on the wire (NOTE [ P2P matching ], rule 6), alive until the operation
        # is done; a receive's is then copied into ``tensor``.
        self.staged, self.receive = staged, receive

    def wait(self) -> None:
        """Wait for the operation; raise MegatronCoreError naming the peer on failure."""
        if self.work is None:
            return
        work, self.work = self.work, None
        try:
            try:
                ok = work.wait() if self.timeout is None else work.wait(self.timeout)
            except RuntimeError as error:
                raise MegatronCoreError(
                    f"pipeline p2p: {self.peer} failed or timed out (timeout {self.timeout}): "
                    f"{error}"
                ) from error
            if ok is False:
                raise MegatronCoreError(f"pipeline p2p: {self.peer} did not complete")
            if self.staged is not None and self.receive:
                with torch.no_grad():  # the receive buffer is a leaf that requires grad
                    self.tensor.copy_(self.staged)
        finally:
            self.tensor = self.staged = None


def wait_all(requests: dict[str, Request]) -> None:
    """Wait for every request of one exchange."""
    for request in requests.values():
        request.wait()


def _describe(name: str, next_rank: int, prev_rank: int) -> str:
    peer = next_rank if name.endswith("next") else prev_rank
    verb, side = name.split("_")
    return f"{verb} {'to' if verb == 'send' else 'from'} {side} rank {peer}"


def post(
    tensors: dict[str, torch.Tensor | None],
    *,
    group,
    pp_rank: int,
    next_rank: int,
    prev_rank: int,
    batched: bool,
    timeout: datetime.timedelta | None,
    tags: dict[str, int] = TAGS,
) -> dict[str, Request]:
    """Post the non-None entries of ``tensors`` (keyed send_next, recv_prev, send_prev,
    recv_next) in the rank-parity order of NOTE [ P2P matching ], rule 2; return their handles."""
    order = _EVEN_ORDER if pp_rank % 2 == 0 else _ODD_ORDER
    names = [name for name in order if tensors.get(name) is not None]
    peers = {n: next_rank if n.endswith("next") else prev_rank for n in names}
    ops = {n: dist.isend if n.startswith("send") else dist.irecv for n in names}
    wire = _host_staged(tensors, names, group)
    if batched and names:
        works = dist.batch_isend_irecv(
            [dist.P2POp(ops[n], wire[n], peers[n], group, tags[n]) for n in names]
        )
    else:
        works = [ops[n](wire[n], peers[n], group=group, tag=tags[n]) for n in names]
    return {
        n: Request(
            w,
            _describe(n, next_rank, prev_rank),
            timeout,
            tensors[n],
            staged=wire[n] if wire[n] is not tensors[n] else None,
            receive=n.startswith("recv"),
        )
        for n, w in zip(names, works)
    }


def _host_staged(tensors, names, group) -> dict[str, torch.Tensor]:
    """The tensors that go on the wire (NOTE [ P2P matching ], rule 6): on a gloo group a device
    tensor becomes a CPU copy (sends) or a CPU buffer of its shape and dtype (receives)."""
    wire = {n: tensors[n] for n in names}
    if not names or dist.get_backend(group) != "gloo":
        return wire
    for n in names:
        t = tensors[n]
        if t.device.type == "cpu":
            continue
        wire[n] = t.detach().cpu() if n.startswith("send") else torch.empty_like(t, device="cpu")
    return wire


def exchange_shapes(send_next, send_prev, recv_prev: bool, recv_next: bool, **post_args):
    """NOTE [ P2P matching ], rule 5: send the shapes of the tensors about to be sent and
    receive those about to arrive (3 int64 each); returns (shape from prev, shape from next)."""

    def shape_of(tensor):
        if tensor is None:
            return None
        return torch.tensor(tensor.shape, dtype=torch.int64, device=device.current_device())

    def buffer(wanted: bool):
        return torch.empty(3, dtype=torch.int64, device=device.current_device()) if wanted else None

    tensors = {
        "send_next": shape_of(send_next),
        "recv_prev": buffer(recv_prev),
        "send_prev": shape_of(send_prev),
        "recv_next": buffer(recv_next),
    }
    wait_all(post(tensors, tags=SHAPE_TAGS, **post_args))
    shapes = [tensors["recv_prev"], tensors["recv_next"]]
    return tuple(None if s is None else tuple(s.tolist()) for s in shapes)
