"""Deferred output-layer weight gradients (``config.defer_embedding_wgrad_compute``).

With that option the last stage's output layer keeps its inputs (``embedding_activation_buffer``)
and output gradients (``grad_output_buffer``) instead of computing its weight gradient in every
backward; the schedule clears the buffers before the step and computes the gradient after the
last backward, accumulating into the weight's ``main_grad``.
"""

from __future__ import annotations

import torch

from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["clear_embedding_activation_buffer", "finish_embedding_wgrad_compute"]


def _module_with(model, attribute: str):
    """The first of model, model.module, ... that has ``attribute``."""
    inner = model
    while inner is not None and not hasattr(inner, attribute):
        inner = getattr(inner, "module", None)
    return inner


def clear_embedding_activation_buffer(config, model, is_last_stage: bool):
    """On the last stage with ``config.defer_embedding_wgrad_compute``: empty the output layer's
    activation buffer (of the last chunk when ``model`` is a list) and return the module that
    holds it; else None."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return None
    chunk = model[-1] if isinstance(model, list) else model
    embedding_module = _module_with(chunk, "post_process")
    embedding_module.embedding_activation_buffer.clear()
    return embedding_module


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage: bool, tp_group):
    """On the last stage with ``config.defer_embedding_wgrad_compute``: compute the deferred
    output-layer weight gradient ``sum_i grad_output_i^T @ input_i`` (inputs gathered over
    ``tp_group`` under sequence parallelism) into the weight's ``main_grad``."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return
    inputs = embedding_module.embedding_activation_buffer
    grads = embedding_module.grad_output_buffer
    if len(inputs) != len(grads):
        raise RuntimeError(
            f"finish_embedding_wgrad_compute: {len(inputs)} buffered inputs but {len(grads)} "
            "buffered output gradients"
        )
    if embedding_module.share_embeddings_and_output_weights:
        weight = embedding_module.shared_embedding_or_output_weight()
    else:
        weight = embedding_module.output_layer.weight
    sequence_parallel = getattr(config, "sequence_parallel", False)
    with torch.no_grad():
        while inputs:
            activation, grad_output = inputs.pop(0), grads.pop(0)
            if sequence_parallel:
                activation = gather_from_sequence_parallel_region(activation, group=tp_group)
            activation = activation.reshape(-1, activation.shape[-1])
            grad_output = grad_output.reshape(-1, grad_output.shape[-1])
            weight.main_grad.add_((grad_output.t() @ activation).to(weight.main_grad.dtype))
