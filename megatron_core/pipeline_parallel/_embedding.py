"""Deferred output-layer weight gradients (``config.defer_embedding_wgrad_compute``).

With that option the last stage's output layer keeps its inputs (``embedding_activation_buffer``)
and output gradients (``grad_output_buffer``) instead of computing its weight gradient in every
backward; the schedule clears the buffers before the step and computes the gradient after the
last backward, accumulating into the weight's ``main_grad`` (megatron-core's semantics: only with
``gradient_accumulation_fusion``, which the deferral requires).
"""

from __future__ import annotations

from megatron_core.utils import drain_embedding_wgrad_compute

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
    output-layer weight gradient from the module's buffers (``utils.drain_embedding_wgrad_compute``,
    inputs gathered over ``tp_group`` under sequence parallelism) into the weight's
    ``main_grad``. The weight is the output layer's, or the shared embedding when the output
    layer shares it."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return
    if embedding_module.share_embeddings_and_output_weights:
        weight = embedding_module.shared_embedding_or_output_weight()
    else:
        weight = embedding_module.output_layer.weight
    drain_embedding_wgrad_compute(
        config,
        embedding_module.embedding_activation_buffer,
        embedding_module.grad_output_buffer,
        weight,
        tp_group,
    )
