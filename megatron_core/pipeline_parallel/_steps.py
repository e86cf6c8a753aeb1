"""The pieces every schedule shares: one microbatch's forward (and loss) and its backward.

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
4. As in megatron-core, a chunk's ``set_input_tensor`` always receives a list (``[tensor]``, or
   ``[None]`` where nothing was received: the first stage), and a tensor or a list comes back
   from ``forward_step`` / ``backward_step`` as it was given.
5. Nothing of a microbatch outlives its backward in the schedule: the 1F1B schedule holds a
   microbatch in its input and output lists alone (no local variable keeps the warm-up's last
   forward, nor the steady loop's last microbatch, past its backward, nor its input gradient
   past its send, which kept one [s, b, h] tensor through the next forward and backward). A
   held output keeps its graph alive, and with it what the graph's nodes hold after their
   backward (a checkpoint's RNG states, the received input), through later forwards: 65 KiB
   of stage 0's 1.2 MiB peak and 32 KiB of the last stage's 1.6 MiB in the recompute
   planner's pipeline stages (docs/benchmarks/recompute-planner.md). The interleaved
   schedule's outputs leave with the backward that pops them.
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
from megatron_core.pipeline_parallel._args import option

__all__ = [
    "deallocate_output_tensor",
    "custom_backward",
    "set_current_microbatch",
    "forward_step_calc_loss",
    "forward_step",
    "backward_step",
    "backward_step_multimodule",
    "check_first_val_step",
    "get_tensor_device",
    "get_model_config",
    "set_input_tensor",
]


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


def set_input_tensor(model: torch.nn.Module, input_tensor: list) -> None:
    """Hand the received activations (a list, NOTE [ Pipeline outputs ], rule 4) to the chunk's
    ``set_input_tensor``. A model without one is accepted only where nothing is received."""
    setter = _unwrap(model, "set_input_tensor")
    if setter is not None:
        setter(input_tensor)
    elif any(t is not None for t in input_tensor):
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


def _calls_with_checkpoint_flag(func: Callable) -> bool:
    try:
        return len(inspect.signature(func).parameters) >= 3
    except (TypeError, ValueError):
        return False


def set_current_microbatch(model: torch.nn.Module, microbatch_id: int) -> None:
    """Record ``microbatch_id`` as ``current_microbatch`` on every layer of the (possibly
    wrapped) model's ``decoder`` (and of its ``mtp`` block's transformer layers); no-op for a
    model without a decoder."""
    inner = model
    while inner is not None and getattr(inner, "decoder", None) is None:
        inner = getattr(inner, "module", None)
    if inner is None:
        return
    for layer in inner.decoder.layers:
        layer.current_microbatch = microbatch_id
    mtp = getattr(inner, "mtp", None)
    if mtp is not None:
        for layer in mtp.layers:
            layer.transformer_layer.current_microbatch = microbatch_id


def _scale(value, device: torch.device, what: str) -> torch.Tensor:
    """A loss-scale hook's result as a size-1 tensor on ``device``."""
    scale = torch.as_tensor(value, device=device)
    if scale.numel() != 1:
        raise MegatronCoreError(
            f"forward_step_calc_loss: {what} must return a scalar or a size-1 tensor, "
            f"got {scale.numel()} elements"
        )
    return scale.reshape(1)


def _aux_loss_scale(config, output_tensor, cp_group_size: int, num_microbatches: int) -> None:
    """megatron-core's auxiliary-loss scales (MoE router, MTP, and 0.19's experimental
    attention variants such as DSA's indexer loss), set when their modules are in use (already
    imported: this package never imports megatron-core itself).

    Each scale is ``grad_scale_func(1)`` (1 without it), or 0.19's ``moe_grad_scale_func()`` /
    ``mtp_grad_scale_func()`` where given; without per-token loss it is divided by the number of
    microbatches, and for MoE and the attention variant multiplied by the CP size.
    """
    import sys

    if isinstance(output_tensor, dict):  # 0.19: a dict of output tensors
        output_tensor = next(iter(output_tensor.values()), None)
    if not isinstance(output_tensor, torch.Tensor):
        return
    device = output_tensor.device
    per_token = option(config, "calculate_per_token_loss", False)

    def base(own_func: str | None) -> torch.Tensor:
        func = option(config, own_func) if own_func else None
        if func is not None:
            return _scale(func(), device, own_func)
        scale_func = option(config, "grad_scale_func")
        one = torch.ones(1, device=device)
        return _scale(scale_func(one), device, "grad_scale_func") if scale_func else one

    def setter(module_name: str, attribute: str):
        module = sys.modules.get(module_name)
        return None if module is None else getattr(module, attribute).set_loss_scale

    if option(config, "num_moe_experts") is not None:
        moe = setter("megatron.core.transformer.moe.router", "MoEAuxLossAutoScaler")
        if moe is not None:
            scale = base("moe_grad_scale_func")
            moe(scale if per_token else scale * cp_group_size / num_microbatches)
    if option(config, "mtp_num_layers") is not None:
        mtp = setter("megatron.core.transformer.multi_token_prediction", "MTPLossAutoScaler")
        if mtp is not None:
            scale = base("mtp_grad_scale_func")
            mtp(scale if per_token else scale / num_microbatches)
    variant = option(config, "experimental_attention_variant_loss_scale_func")
    if variant is None and option(config, "experimental_attention_variant") == "dsa":
        variant = setter(
            "megatron.core.transformer.experimental_attention_variant.dsa",
            "DSAIndexerLossAutoScaler",
        )
    if variant is not None:
        scale = base(None)
        variant(scale if per_token else scale * cp_group_size / num_microbatches)


def forward_step_calc_loss(
    model,
    output_tensor,
    loss_func,
    config,
    vp_stage,
    collect_non_loss_data,
    num_microbatches,
    forward_data_store,
    cp_group_size=None,
    is_last_stage=None,
):
    """On the last stage, turn the chunk's output into the scaled loss (NOTE [ Pipeline
    outputs ], rule 3) and append ``loss_func``'s dict (or the output itself without a
    loss_func, or ``loss_func(output, non_loss_data=True)`` when collecting) to
    ``forward_data_store``. ``cp_group_size`` and ``is_last_stage`` both None: parallel_state's.

    Returns:
        (output: the loss on the last stage, else unchanged; tokens, a 0-dim int tensor).
    """
    model_vp_stage = getattr(model, "vp_stage", None)
    if vp_stage is not None and model_vp_stage is not None and vp_stage != model_vp_stage:
        raise MegatronCoreError(
            f"forward_step_calc_loss: vp_stage ({vp_stage}) differs from the model chunk's "
            f"vp_stage ({model_vp_stage})"
        )
    if cp_group_size is None and is_last_stage is None:
        cp_group_size = parallel_state.get_context_parallel_world_size()
        is_last_stage = parallel_state.is_pipeline_last_stage(
            ignore_virtual=False, vp_stage=vp_stage
        )
    elif cp_group_size is None or is_last_stage is None:
        raise MegatronCoreError(
            f"forward_step_calc_loss: give both cp_group_size ({cp_group_size}) and "
            f"is_last_stage ({is_last_stage}), or neither"
        )
    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
        output_tensor, num_tokens = _loss(
            output_tensor,
            loss_func,
            config,
            collect_non_loss_data,
            num_microbatches,
            cp_group_size,
            forward_data_store,
        )
    _aux_loss_scale(config, output_tensor, cp_group_size, num_microbatches)
    return output_tensor, num_tokens


def _loss(output_tensor, loss_func, config, collect, num_microbatches, cp_size, store):
    """Apply ``loss_func`` on the last stage (megatron's reductions); returns (loss, tokens)."""
    num_tokens = torch.tensor(0, dtype=torch.int)
    if loss_func is None:
        store.append(output_tensor)
    elif collect:
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
    input_tensor,
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

    Hands the chunk its input as a list (NOTE [ Pipeline outputs ], rule 4; ``[None]`` on the
    first stage, where the chunk reads ``data_iterator``), calls
    ``forward_step_func(data_iterator, model)`` -> (output, loss_func) (under ``torch.autocast``
    when ``config.enable_autocast``) and, on the last stage, :func:`forward_step_calc_loss`.

    Returns:
        (output: the activation [s, b, h] to send, or the scalar loss on the last stage; a
        list of one when ``input_tensor`` was a list; number of tokens, a 0-dim int tensor).
    """
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    if current_microbatch is not None:
        set_current_microbatch(model, current_microbatch)
    unwrap = not isinstance(input_tensor, list)
    set_input_tensor(model, [input_tensor] if unwrap else input_tensor)
    with _autocast(config):
        if checkpoint_activations_microbatch is not None and _calls_with_checkpoint_flag(
            forward_step_func
        ):
            output_tensor, loss_func = forward_step_func(
                data_iterator, model, checkpoint_activations_microbatch
            )
        else:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
    output_tensor, num_tokens = forward_step_calc_loss(
        model,
        output_tensor,
        loss_func,
        config,
        vp_stage,
        collect_non_loss_data,
        num_microbatches,
        forward_data_store,
        cp_group_size,
        is_last_stage,
    )
    return (output_tensor if unwrap else [output_tensor]), num_tokens


def _as_list(value) -> tuple[list, bool]:
    return (value, False) if isinstance(value, list) else ([value], True)


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type=None, config=None):
    """Backward of one microbatch through one chunk; returns the gradient of its input.

    ``output_tensor_grad`` is the gradient received from the next stage (None on the last
    stage, where ``output_tensor`` is the loss; ``config.grad_scale_func`` scales it first).
    Parameter gradients accumulate into ``.grad`` / ``.main_grad``; the returned gradient of
    ``input_tensor`` (None on the first stage; a list when ``input_tensor`` is a list) goes to
    the previous stage. Both megatron-core 0.16.1's ``(input, output, grad, model_type,
    config)`` and 0.19's ``(input, output, grad, config)`` calls work; an output that does
    not require grad (a stage that did not take part) is skipped.
    """
    if config is None and not isinstance(model_type, (str, enum.Enum, type(None))):
        config = model_type  # megatron-core 0.19 passes the config 4th, without model_type
    inputs, unwrap = _as_list(input_tensor)
    for x in inputs:
        if x is not None:
            x.retain_grad()
    outputs, _ = _as_list(output_tensor)
    grads, _ = _as_list(output_tensor_grad)
    output, grad = outputs[0], grads[0]
    scale = option(config, "grad_scale_func")
    if grad is None and scale is not None:
        output = scale(output)
    if output.requires_grad:
        if option(config, "deallocate_pipeline_outputs", False):
            custom_backward(output, grad)
        else:
            torch.autograd.backward(output, grad_tensors=grad)
    input_grads = [None if x is None else x.grad for x in inputs]
    return input_grads[0] if unwrap else input_grads


def backward_step_multimodule(
    input_tensor, output_tensor, output_tensor_grad, config, language_model_module_name: str
) -> dict:
    """megatron-core 0.19's backward of a multi-module stage: tensors are dicts keyed by module
    name (a bare output is the loss of ``language_model_module_name``; no ``output_tensor_grad``
    means the last stage); each module's output runs its own backward. Returns the input
    gradients by module name (None for an input that is None)."""

    def single(tensor):
        return tensor[0] if isinstance(tensor, list) else tensor

    inputs = {name: single(t) for name, t in input_tensor.items()}
    for tensor in inputs.values():
        if tensor is not None:
            tensor.retain_grad()
    if not isinstance(output_tensor, dict):
        output_tensor = {language_model_module_name: output_tensor}
    grads = output_tensor_grad or dict.fromkeys(output_tensor)
    for name, output in output_tensor.items():
        output, grad = single(output), single(grads[name])
        if grad is None and option(config, "grad_scale_func") is not None:
            output = config.grad_scale_func(output)
        if output is not None and output.requires_grad:
            if option(config, "deallocate_pipeline_outputs", False):
                custom_backward(output, grad)
            else:
                torch.autograd.backward(output, grad_tensors=grad)
    return {name: None if t is None else t.grad for name, t in inputs.items()}


def check_first_val_step(first_val_step, forward_only, cond):
    """``first_val_step and cond`` for a forward-only pass given ``first_val_step``; else
    ``cond`` (whether this is the chunk's first microbatch)."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def get_tensor_device(tensor) -> torch.device:
    """The device of a tensor, or of the first tensor of a dict of tensors (megatron-core
    0.19)."""
    if isinstance(tensor, dict):
        return next(iter(tensor.values())).device
    return tensor.device
