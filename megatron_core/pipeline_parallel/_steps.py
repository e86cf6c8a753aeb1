"""The pieces every schedule shares: one microbatch's forward and backward, input checks, shapes.

Re-exported by :mod:`megatron_core.pipeline_parallel.schedules` under megatron-core's names.

# NOTE [ Pipeline outputs ]
1. A stage's forward output goes to the next stage as a copy (p2p), so after the send only its
   ``grad_fn`` is still needed. With ``config.deallocate_pipeline_outputs`` the schedule swaps its
   data for a 1-element tensor right after the send (``deallocate_output_tensor``), which frees
   the [s, b, h] buffer while the microbatch waits for its backward.
2. ``torch.autograd.backward`` checks that a gradient matches its tensor's shape, which a
   deallocated output no longer has; ``custom_backward`` therefore calls the autograd engine
   directly (as megatron-core does), which only checks the graph.
3. The last stage's output is the loss of the microbatch, already divided by the number of
   microbatches (and multiplied by the context-parallel size, megatron's convention), so the
   gradients summed over microbatches are those of the mean loss.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
from collections.abc import Callable

import torch
from torch.autograd import Variable

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator

__all__ = [
    "deallocate_output_tensor",
    "custom_backward",
    "forward_step",
    "backward_step",
    "get_tensor_shapes",
    "get_model_config",
    "set_input_tensor",
]


def option(config, name: str, default=None):
    """A schedule option of ``config``, or megatron-core's default when the config lacks it."""
    return getattr(config, name, default)


def _unwrap(model: torch.nn.Module, attribute: str):
    """The first of model, model.module, model.module.module, ... that has ``attribute``."""
    inner = model
    while inner is not None:
        if hasattr(inner, attribute):
            return getattr(inner, attribute)
        inner = getattr(inner, "module", None)
    return None


def get_model_config(model: torch.nn.Module):
    """The ``config`` attribute of a (possibly wrapped) model chunk."""
    config = _unwrap(model, "config")
    if config is None:
        raise MegatronCoreError(
            f"pipeline schedule: model {type(model).__name__} has no 'config' attribute "
            "(a ModelParallelConfig / TransformerConfig)"
        )
    return config


def set_input_tensor(model: torch.nn.Module, input_tensor: torch.Tensor | None) -> None:
    """Hand the received activation to the chunk (its ``set_input_tensor``), as megatron does.

    A model without ``set_input_tensor`` is accepted only where nothing is received (None).
    """
    setter = _unwrap(model, "set_input_tensor")
    if setter is not None:
        setter(input_tensor)
    elif input_tensor is not None:
        raise MegatronCoreError(
            f"pipeline schedule: model {type(model).__name__} receives an activation from the "
            "previous stage but has no set_input_tensor(tensor) method"
        )


def deallocate_output_tensor(out: torch.Tensor | None, deallocate_pipeline_outputs: bool = False):
    """Replace ``out``'s data by a 1-element tensor, keeping its ``grad_fn`` (NOTE [ Pipeline
    outputs ], rule 1). No-op when ``out`` is None or ``deallocate_pipeline_outputs`` is False.

    Raises:
        MegatronCoreError: ``out`` is a view (freeing it would not free its base).
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    if isinstance(out, (list, tuple)):
        for item in out:
            deallocate_output_tensor(item, deallocate_pipeline_outputs)
        return
    if out._base is not None:
        raise MegatronCoreError(
            "deallocate_output_tensor: the output is a view of another tensor; freeing it would "
            "not free memory (make the stage return a fresh tensor)"
        )
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from ``output`` with ``grad_output`` straight through the autograd engine, so a
    deallocated output (1 element) can take its full-shape gradient (NOTE [ Pipeline outputs ],
    rule 2). A None ``grad_output`` means ones (``output`` must then have one element)."""
    if grad_output is None:
        if output.numel() != 1:
            raise MegatronCoreError(
                f"custom_backward: implicit gradient needs a 1-element output, got shape "
                f"{tuple(output.shape)}"
            )
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def get_tensor_shapes(
    *, seq_length: int, micro_batch_size: int, config, tp_size: int = 1, cp_size: int = 1
) -> list[tuple[int, int, int]]:
    """The shape sent between stages: [(s / cp (/ tp under SP), micro_batch_size, hidden)]."""
    s = seq_length // cp_size
    if option(config, "sequence_parallel", False):
        s //= tp_size
    return [(s, micro_batch_size, config.hidden_size)]


def _calls_with_checkpoint_flag(func: Callable) -> bool:
    try:
        return len(inspect.signature(func).parameters) >= 3
    except (TypeError, ValueError):
        return False


def _loss(
    output_tensor, loss_func, config, collect_non_loss_data, num_microbatches, cp_size, store
):
    """Apply ``loss_func`` on the last stage (megatron's reductions); returns (loss, tokens)."""
    num_tokens = torch.tensor(0, dtype=torch.int)
    if loss_func is None:
        store.append(output_tensor)
    elif collect_non_loss_data:
        store.append(loss_func(output_tensor, non_loss_data=True))
    else:
        outputs = loss_func(output_tensor)
        if len(outputs) == 3:
            output_tensor, num_tokens, reduced = outputs
            if not option(config, "calculate_per_token_loss", False):
                output_tensor = output_tensor / torch.clamp(num_tokens, min=1)
                output_tensor = output_tensor / num_microbatches
        elif len(outputs) == 2:
            output_tensor, reduced = outputs
            output_tensor = output_tensor * cp_size / num_microbatches
        else:
            raise MegatronCoreError(
                f"pipeline schedule: loss_func must return (loss, dict) or (loss, num_tokens, "
                f"dict), got {len(outputs)} values"
            )
        store.append(reduced)
    return output_tensor, num_tokens


def _autocast(config) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on the current device when ``config.enable_autocast`` (megatron-core)."""
    if not option(config, "enable_autocast", False):
        return contextlib.nullcontext()
    return torch.autocast(device.device_type(), dtype=option(config, "autocast_dtype"))


def forward_step(
    forward_step_func: Callable,
    data_iterator,
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: torch.Tensor | None,
    forward_data_store: list,
    config,
    cp_group_size: int = 1,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: bool | None = None,
    is_first_microbatch: bool = False,
    current_microbatch: int | None = None,
    vp_stage: int | None = None,
    is_last_stage: bool = True,
):
    """Run one microbatch through one model chunk.

    Sets the chunk's input (None on the first stage: the chunk reads ``data_iterator``), calls
    ``forward_step_func(data_iterator, model)`` -> (output, loss_func) (under ``torch.autocast``
    when ``config.enable_autocast``) and, on the last stage,
    turns the output into the scaled loss (NOTE [ Pipeline outputs ], rule 3) and appends
    ``loss_func``'s dict to ``forward_data_store``.

    Returns:
        (output tensor: the activation [s, b, h] to send, or the scalar loss on the last stage;
        number of tokens, a 0-dim int tensor, 0 unless loss_func returned it).
    """
    set_input_tensor(model, input_tensor)
    with _autocast(config):
        if checkpoint_activations_microbatch is not None and _calls_with_checkpoint_flag(
            forward_step_func
        ):
            output_tensor, loss_func = forward_step_func(
                data_iterator, model, checkpoint_activations_microbatch
            )
        else:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output_tensor, torch.tensor(0, dtype=torch.int)
    return _loss(
        output_tensor,
        loss_func,
        config,
        collect_non_loss_data,
        num_microbatches,
        cp_group_size,
        forward_data_store,
    )


def backward_step(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    model_type=None,
    config=None,
) -> torch.Tensor | None:
    """Backward of one microbatch through one chunk; returns the gradient of its input.

    ``output_tensor_grad`` is the gradient received from the next stage (None on the last
    stage, where ``output_tensor`` is the loss; ``config.grad_scale_func`` scales it first).
    Parameter gradients accumulate into ``.grad`` / ``.main_grad``; the returned gradient of
    ``input_tensor`` (None on the first stage) goes to the previous stage.
    """
    if config is None and not isinstance(model_type, (str, enum.Enum, type(None))):
        config = model_type  # newer megatron-core passes the config 4th, without model_type
    if input_tensor is not None:
        input_tensor.retain_grad()
    scale = option(config, "grad_scale_func")
    if output_tensor_grad is None and scale is not None:
        output_tensor = scale(output_tensor)
    if option(config, "deallocate_pipeline_outputs", False):
        custom_backward(output_tensor, output_tensor_grad)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return None if input_tensor is None else input_tensor.grad


def no_sync_context(config) -> Callable[[], contextlib.AbstractContextManager]:
    """``config.no_sync_func`` (DDP's grad-sync suppression) or a null context."""
    return option(config, "no_sync_func") or contextlib.nullcontext


def finalize(config, model: list, num_tokens: torch.Tensor, forward_only: bool) -> None:
    """Call ``config.finalize_model_grads_func(model, num_tokens)`` after a training pass."""
    func = option(config, "finalize_model_grads_func")
    if func is None or forward_only:
        return
    per_token = option(config, "calculate_per_token_loss", False)
    func(model, num_tokens if per_token else None)


def one_chunk(value, name: str):
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise MegatronCoreError(
                f"pipeline schedule: non-interleaved schedules take one {name}, got a list of "
                f"{len(value)} (interleaving needs virtual_pipeline_model_parallel_size)"
            )
        return value[0]
    return value


def check_schedule_args(
    *, num_microbatches, seq_length, micro_batch_size, config, pp_size: int, tp_size: int = 1
) -> None:
    """Raise MegatronCoreError for arguments no schedule can run, before any communication."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise MegatronCoreError(
            f"pipeline schedule: num_microbatches ({num_microbatches!r}) must be an int"
        )
    if num_microbatches < 1:
        raise MegatronCoreError(
            f"pipeline schedule: num_microbatches ({num_microbatches}) must be >= 1"
        )
    if pp_size == 1:
        return
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MegatronCoreError(f"pipeline schedule: {name} ({value!r}) must be an int >= 1")
    if option(config, "pipeline_dtype") is None:
        raise MegatronCoreError(
            f"pipeline schedule: config.pipeline_dtype must be set when the pipeline size "
            f"({pp_size}) > 1"
        )
    if option(config, "hidden_size") is None:
        raise MegatronCoreError("pipeline schedule: config.hidden_size is needed for the p2p shape")
    if option(config, "variable_seq_lengths", False):
        raise MegatronCoreError("pipeline schedule: variable_seq_lengths (True) is not supported")
    if option(config, "sequence_parallel", False) and seq_length % tp_size:
        raise MegatronCoreError(
            f"pipeline schedule: seq_length ({seq_length}) must be divisible by the "
            f"tensor-parallel size ({tp_size}) under sequence parallelism"
        )


def communicator(p2p_communicator, pg_collection, config) -> P2PCommunicator:
    if p2p_communicator is not None:
        return p2p_communicator
    group = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    if group is None:
        group = parallel_state.get_pipeline_model_parallel_group()
    return P2PCommunicator(group, config)


def parallel_sizes(pg_collection) -> tuple[int, int]:
    """(tp size, cp size) from the collection or parallel_state."""
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    tp_size = tp.size() if tp is not None else parallel_state.get_tensor_model_parallel_world_size()
    cp_size = cp.size() if cp is not None else parallel_state.get_context_parallel_world_size()
    return tp_size, cp_size
