"""Point-to-point communication between adjacent pipeline stages (megatron-core's API).

A stage sends its output activation forward (to the next stage) and receives the gradient of that
activation backward (from the next stage); it receives its input activation from the previous
stage and sends the gradient of that input back. :class:`P2PCommunicator` does this over one
pipeline group: the ranks of the group form a ring, so the last stage's "next" is the first stage
(the interleaved schedule sends the last stage's chunk-k output to the first stage's chunk k+1).

# NOTE [ P2P matching ]
1. Every call posts all its sends and receives as non-blocking operations, then (unless the caller
   asks for the handles) waits for all of them: no rank blocks in a send before its peers posted
   their receives, so any interleaving of neighbours' calls that pairs up completes.
2. With two stages both neighbours are the same rank, and a call may carry both an activation and
   a gradient to it. Messages between one pair of ranks match in posting order, so each rank posts
   its operations in an order that pairs with its neighbour's: even stages post send-next,
   recv-prev, send-prev, recv-next; odd stages recv-prev, send-next, recv-next, send-prev (the
   order megatron-core uses for its unbatched path). On top of that, activations travel with tag
   0 and gradients with tag 1 (gloo matches by tag; NCCL ignores tags and relies on the order).
3. ``batch_p2p_comm=True`` hands the same list of operations to ``batch_isend_irecv``;
   ``False`` issues them one by one. Both wait before returning when ``wait_on_reqs``; without
   it the caller gets one handle per operation and waits for each when it needs it.
4. Waiting is bounded: a communicator created with ``timeout`` waits at most that long for each
   operation and then raises :class:`~megatron_core.errors.MegatronCoreError` naming the peer, so
   a stage whose neighbour died does not hang (without it, the process group's timeout applies).
5. ``variable_seq_lengths``: before the tensors, each call exchanges their shapes (3 int64, tags
   2 and 3) with the same peers and waits, then allocates the receive buffers at the received
   shapes. The overlapped schedule still overlaps the tensors themselves.
6. A gloo group moves device (CUDA) tensors through host memory: gloo's send and receive take
   the tensor's pointer as a host address (the transfer fails with "Bad address"), so a device
   tensor is sent as a CPU copy and received into a CPU buffer that ``wait`` copies into the
   device tensor. NCCL and the per-device ``cuda:nccl,cpu:gloo`` map move device tensors as
   they are.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel._p2p_ops import exchange_shapes, post, wait_all

__all__ = [
    "P2PCommunicator",
    "is_single_shape",
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
]

Shape = Sequence[int] | torch.Size


def is_single_shape(x) -> bool:
    """True for one shape (a ``torch.Size`` or a non-empty list/tuple of ints), False for a
    list of shapes (or anything else)."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(d, int) for d in x)


def _option(config, name: str, default):
    """A pipeline option of ``config`` with megatron-core's default when the config lacks it."""
    return getattr(config, name, default)


class P2PCommunicator:
    """Send and receive activations and gradients between neighbouring stages of one pipeline.

    Shapes: every tensor exchanged in one call has ``tensor_shape`` (megatron's
    ``(seq_length, micro_batch_size, hidden_size)``, ``seq_length / tp`` under sequence
    parallelism) and dtype ``config.pipeline_dtype``; with ``config.variable_seq_lengths`` the
    shapes travel first (NOTE [ P2P matching ], rule 5). Received tensors are fresh leaves with
    ``requires_grad=True`` on the current device, so the receiving stage's backward fills their
    ``.grad``.

    Args:
        pp_group: the pipeline process group (one rank per stage, in stage order).
        config: a ModelParallelConfig; reads ``pipeline_dtype`` and, when present,
            ``batch_p2p_comm`` (default True), ``variable_seq_lengths`` and
            ``virtual_pipeline_model_parallel_size``.
        timeout: extension: the longest wait for one operation before raising (NOTE [ P2P
            matching ], rule 4); None waits as long as the process group allows.
    """

    def __init__(self, pp_group, config, *, timeout: datetime.timedelta | None = None):
        if pp_group is None:
            raise MegatronCoreError("P2PCommunicator: pp_group is None")
        self.pp_group = pp_group
        self.config = config
        self.timeout = timeout
        ranks = dist.get_process_group_ranks(pp_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = len(ranks)
        self.next_rank = ranks[(self.pp_rank + 1) % self.pp_size]
        self.prev_rank = ranks[(self.pp_rank - 1) % self.pp_size]
        self.virtual_pipeline_model_parallel_size = _option(
            config, "virtual_pipeline_model_parallel_size", None
        )

    @property
    def is_pp_first_stage(self) -> bool:
        """True on the first stage of the pipeline (ignoring virtual stages)."""
        return self.pp_rank == 0

    @property
    def is_pp_last_stage(self) -> bool:
        """True on the last stage of the pipeline (ignoring virtual stages)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def total_stages(self) -> int:
        """Number of pipeline stages (the group's size)."""
        return self.pp_size

    @property
    def current_stage(self) -> int:
        """This rank's stage, 0-based (its rank in the group)."""
        return self.pp_rank

    def _empty(self, shape: Shape, what: str) -> torch.Tensor:
        dtype = _option(self.config, "pipeline_dtype", None)
        if dtype is None:
            raise MegatronCoreError(f"P2PCommunicator: pipeline_dtype must be set to {what}")
        if shape is None:
            raise MegatronCoreError(
                f"P2PCommunicator: tensor_shape must be given to {what}; commonly "
                "(seq_length, micro_batch_size, hidden_size)"
            )
        return torch.empty(
            tuple(shape), dtype=dtype, device=device.current_device(), requires_grad=True
        )

    def _variable(self) -> bool:
        return bool(_option(self.config, "variable_seq_lengths", False)) or bool(
            _option(self.config, "mtp_standalone", False)
        )

    def _check_sent(self, tensor: torch.Tensor, peer: str, tensor_shape) -> None:
        """The receiver allocates pipeline_dtype x tensor_shape: a sent tensor must match them."""
        dtype = _option(self.config, "pipeline_dtype", None)
        if dtype is not None and tensor.dtype != dtype:
            raise MegatronCoreError(
                f"pipeline p2p: tensor sent to the {peer} stage has dtype {tensor.dtype} but "
                f"config.pipeline_dtype is {dtype} (the receiver would misread its bytes)"
            )
        if self._variable():
            if tensor.dim() != 3:
                raise MegatronCoreError(
                    f"pipeline p2p: with variable_seq_lengths a sent tensor must be 3-D "
                    f"[s, b, h], got shape {tuple(tensor.shape)}"
                )
        elif tensor_shape is not None and tuple(tensor.shape) != tuple(tensor_shape):
            raise MegatronCoreError(
                f"pipeline p2p: tensor sent to the {peer} stage has shape {tuple(tensor.shape)} "
                f"but the pipeline's tensor_shape is {tuple(tensor_shape)}"
            )

    def _communicate(
        self,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape | None,
        wait_on_reqs: bool = True,
    ):
        """Post the sends/receives of one step and (by default) wait for them.

        Returns:
            (tensor received from the previous stage or None, tensor received from the next
            stage or None, the request handles: a dict keyed ``send_next`` / ``recv_prev`` /
            ``send_prev`` / ``recv_next`` when ``wait_on_reqs`` is False, else None).
        """
        for name, sent in (("next", tensor_send_next), ("prev", tensor_send_prev)):
            if sent is not None:
                self._check_sent(sent, name, tensor_shape)
        post_args = dict(
            group=self.pp_group,
            pp_rank=self.pp_rank,
            next_rank=self.next_rank,
            prev_rank=self.prev_rank,
            batched=bool(_option(self.config, "batch_p2p_comm", True)),
            timeout=self.timeout,
        )
        prev_shape = next_shape = tensor_shape
        if self._variable():
            prev_shape, next_shape = exchange_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next, **post_args
            )
        tensors = {
            "send_next": None if tensor_send_next is None else tensor_send_next.detach(),
            "recv_prev": self._empty(prev_shape, "receive from the previous stage")
            if recv_prev
            else None,
            "send_prev": None if tensor_send_prev is None else tensor_send_prev.detach(),
            "recv_next": self._empty(next_shape, "receive from the next stage")
            if recv_next
            else None,
        }
        for name in ("send_next", "send_prev"):
            if tensors[name] is not None:
                tensors[name] = tensors[name].contiguous()
        requests = post(tensors, **post_args)
        if wait_on_reqs:
            wait_all(requests)
            requests = None
        return tensors["recv_prev"], tensors["recv_next"], requests

    @staticmethod
    def _by_shape(shapes, call):
        """megatron-core's convention for receives: one shape -> one tensor, a list of shapes
        -> a list of tensors."""
        if is_single_shape(shapes) or shapes is None:
            return call(None, shapes)
        return [call(None, shape) for shape in shapes]

    @staticmethod
    def _by_tensor(tensors, shapes, call):
        """... and for sends: a tensor -> one result, a list of tensors -> a list, paired with
        the shapes (one shape serves every tensor)."""
        unwrap = not isinstance(tensors, list)
        tensors = [tensors] if unwrap else tensors
        if shapes is None or is_single_shape(shapes):
            shapes = [shapes] * len(tensors)
        results = [call(t, shape) for t, shape in zip(tensors, shapes)]
        return results[0] if unwrap else results

    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        """Receive the input activation from the previous stage (None on the first stage); a
        list of shapes gives a list of tensors."""
        return self._by_shape(
            tensor_shapes,
            lambda _, shape: (
                None if is_first_stage else self._communicate(None, None, True, False, shape)[0]
            ),
        )

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        """Receive the output's gradient from the next stage (None on the last stage)."""
        return self._by_shape(
            tensor_shapes,
            lambda _, shape: (
                None if is_last_stage else self._communicate(None, None, False, True, shape)[1]
            ),
        )

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        """Send the output activation(s) to the next stage (nothing on the last stage)."""
        if not is_last_stage:
            self._by_tensor(
                output_tensors, None, lambda t, _: self._communicate(t, None, False, False, None)
            )

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        """Send the input's gradient(s) to the previous stage (nothing on the first stage)."""
        if not is_first_stage:
            self._by_tensor(
                input_tensor_grads,
                None,
                lambda t, _: self._communicate(None, t, False, False, None),
            )

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        """Send the output forward and receive its gradient, in one step with the next stage."""
        return self._by_tensor(
            output_tensors,
            tensor_shapes,
            lambda t, shape: (
                None if is_last_stage else self._communicate(t, None, False, True, shape)[1]
            ),
        )

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        """Send the input's gradient back and receive the next input, in one step."""
        return self._by_tensor(
            input_tensor_grads,
            tensor_shapes,
            lambda t, shape: (
                None if is_first_stage else self._communicate(None, t, True, False, shape)[0]
            ),
        )

    def send_forward_recv_forward(
        self,
        output_tensor: torch.Tensor | None,
        recv_prev: bool,
        tensor_shape: Shape,
        overlap_p2p_comm: bool = False,
    ):
        """Send an activation to the next stage while receiving one from the previous stage.

        Returns the received tensor (None unless ``recv_prev``); with ``overlap_p2p_comm``,
        ``(tensor, handles)`` where handles maps ``send_next`` / ``recv_prev`` to requests not
        yet waited for (wait ``recv_prev`` before reading the tensor).
        """
        received, _, reqs = self._communicate(
            output_tensor, None, recv_prev, False, tensor_shape, wait_on_reqs=not overlap_p2p_comm
        )
        return (received, reqs) if overlap_p2p_comm else received

    def send_backward_recv_backward(
        self,
        input_tensor_grad: torch.Tensor | None,
        recv_next: bool,
        tensor_shape: Shape,
        overlap_p2p_comm: bool = False,
    ):
        """Send a gradient to the previous stage while receiving one from the next stage
        (handles ``send_prev`` / ``recv_next`` with ``overlap_p2p_comm``)."""
        _, received, reqs = self._communicate(
            None,
            input_tensor_grad,
            False,
            recv_next,
            tensor_shape,
            wait_on_reqs=not overlap_p2p_comm,
        )
        return (received, reqs) if overlap_p2p_comm else received

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: torch.Tensor | None,
        input_tensor_grad: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both directions in one step: returns (input from prev, output grad from next)."""
        received_prev, received_next, _ = self._communicate(
            output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape
        )
        return received_prev, received_next


# --- module-level functions (megatron-core's older functional API) ------------------------------


def _default_communicator(config) -> P2PCommunicator:
    from megatron_core import parallel_state

    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)


def _first() -> bool:
    from megatron_core import parallel_state

    return parallel_state.is_pipeline_first_stage()


def _last() -> bool:
    from megatron_core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def recv_forward(tensor_shape: Shape, config) -> torch.Tensor | None:
    """Receive from the previous stage of parallel_state's pipeline (None on the first stage)."""
    return _default_communicator(config).recv_forward(tensor_shape, _first())


def recv_backward(tensor_shape: Shape, config) -> torch.Tensor | None:
    """Receive a gradient from the next stage (None on the last stage)."""
    return _default_communicator(config).recv_backward(tensor_shape, _last())


def send_forward(output_tensor: torch.Tensor, config) -> None:
    """Send an activation to the next stage (nothing on the last stage)."""
    _default_communicator(config).send_forward(output_tensor, _last())


def send_backward(input_tensor_grad: torch.Tensor, config) -> None:
    """Send a gradient to the previous stage (nothing on the first stage)."""
    _default_communicator(config).send_backward(input_tensor_grad, _first())


def send_forward_recv_backward(output_tensor, tensor_shape: Shape, config):
    """Send forward and receive the gradient from the next stage in one step."""
    return _default_communicator(config).send_forward_recv_backward(
        output_tensor, tensor_shape, _last()
    )


def send_backward_recv_forward(input_tensor_grad, tensor_shape: Shape, config):
    """Send a gradient back and receive the next input from the previous stage in one step."""
    return _default_communicator(config).send_backward_recv_forward(
        input_tensor_grad, tensor_shape, _first()
    )


def send_forward_recv_forward(output_tensor, recv_prev: bool, tensor_shape: Shape, config):
    """Send to the next stage while receiving from the previous one (ring order)."""
    return _default_communicator(config).send_forward_recv_forward(
        output_tensor, recv_prev, tensor_shape
    )


def send_backward_recv_backward(input_tensor_grad, recv_next: bool, tensor_shape: Shape, config):
    """Send to the previous stage while receiving a gradient from the next one."""
    return _default_communicator(config).send_backward_recv_backward(
        input_tensor_grad, recv_next, tensor_shape
    )


def send_forward_backward_recv_forward_backward(
    output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool, tensor_shape: Shape, config
):
    """Both directions at once; returns (input from prev, output grad from next)."""
    return _default_communicator(config).send_forward_backward_recv_forward_backward(
        output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape
    )
