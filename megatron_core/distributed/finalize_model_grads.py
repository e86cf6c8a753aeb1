"""finalize_model_grads: the gradient reductions between the last backward and the optimizer step.

# NOTE [ Gradient finalization ]
After the schedule's last backward every rank holds the gradients of its own microbatches for its
own parameters. Before the optimizer step:
1. Sequence-parallel grads: a replicated parameter marked ``sequence_parallel`` (LayerNorm
   weight/bias, position embeddings under SP) saw only this rank's part of the sequence; its
   gradient is summed over the tensor-parallel group.
2. Data-parallel grads: every gradient is averaged over the data-parallel group (summed instead
   when ``num_tokens`` is given: rule 4 divides by the global token count). Expert parameters
   (``allreduce = False``) differ between expert-parallel ranks: they are summed over the
   expert-data-parallel group and divided by the (dense) data-parallel size, as megatron-core's
   DDP scales them, since their gradients already hold the tokens of every rank they were routed
   from. A chunk that has its own ``finish_grad_sync()`` (a DDP wrapper) does this itself.
3. Tied embeddings: with pp > 1 the word embedding lives on the first stage and its copy (the
   output layer's weight) on the last; their gradients are summed over the embedding group so both
   copies take the same step and stay equal. The copy is marked ``shared = True`` so that grad
   norms and parameter counts see the tied weight once.
4. ``num_tokens`` (per-token loss): the last stage's count is broadcast over the pipeline, summed
   over data-parallel ranks, and every gradient is divided by it.
5. Other TP-replicated parameters (megatron-core's rules): a parameter marked
   ``average_gradients_across_tp_domain`` is averaged over the tensor-parallel group; with
   ``config.qk_layernorm`` the ``q_layernorm`` / ``k_layernorm`` parameters (each TP rank saw
   its own heads) are summed over it.
6. Order. A chunk wrapped in megatron-core's DistributedDataParallel (it has
   ``finish_grad_sync``) finishes its data-parallel reduction first, as megatron-core does: its
   reduction may still be in flight (``overlap_grad_reduce``) on the very buffers rules 1 and 5
   then reduce. Plain chunks keep megatron_core's older order (TP, DP, embeddings), so their
   runs reduce exactly as before. ``num_tokens`` scaling uses a wrapper's ``scale_gradients``.
7. MoE router state (megatron-core's TransformerConfig; chunks read through ``.config``): with
   ``moe_router_enable_expert_bias`` every router's ``expert_bias`` takes one step of
   ``moe_router_bias_update_rate`` towards balance — the tokens each expert got this step,
   summed over the tensor x context x data-parallel group, are compared with their mean and the
   bias moves by the rate times the sign of (mean - count). With
   ``moe_router_load_balancing_type == "quantile_balancing"`` (megatron-core 0.19) every training
   router that accumulates quantiles (``qb_beta_accum`` / ``qb_beta_count``) has the mean of its
   accumulated quantiles averaged over the data x context group, blended into ``qb_beta`` as an
   exponential moving average with weight ``moe_router_quantile_balancing_ema`` on the old value,
   and re-centred to zero mean over the experts. Then the per-step statistics are cleared
   (``reset_model_temporary_tensors``).
8. megatron-core's private helpers, for code and tests that import them by name (0.16.1's
   names and signatures, the same in 0.19): ``_allreduce_word_embedding_grads`` (rule 3 over a
   given embedding group), ``_allreduce_non_tensor_model_parallel_grads`` (rules 1 and 5, the
   sequence-parallel sum only with ``config.sequence_parallel``; ``_allreduce_layernorm_grads``
   is its old name) and ``_allreduce_conditional_embedding_grads`` (embedders replicated on
   every stage, ``config.has_cond_embedder``). ``finalize_model_grads`` itself does not call
   them (rule 6 keeps its order). megatron FSDP's DTensor gradients are not handled.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from megatron_core import consistency, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.layer_params import allreduce_sequence_parallel_grads
from megatron_core.utils import (
    get_attr_wrapped_model,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)

__all__ = ["finalize_model_grads", "reset_model_temporary_tensors"]


def _grad(param: torch.Tensor) -> torch.Tensor | None:
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def _flat_all_reduce(tensors: list[torch.Tensor], group, scale: float | None) -> None:
    """All-reduce (sum) ``tensors`` in place, one collective per dtype; then scale."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        consistency.checked_all_reduce("finalize_model_grads all_reduce", flat, group)
        if scale is not None:
            flat.mul_(scale)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _group(pg_collection, name: str, getter):
    group = getattr(pg_collection, name, None) if pg_collection is not None else None
    return group if group is not None else getter()


def _embedding_weight(chunk: torch.nn.Module) -> torch.Tensor | None:
    inner = chunk
    while inner is not None and not hasattr(inner, "shared_embedding_or_output_weight"):
        inner = getattr(inner, "module", None)
    if inner is None or not getattr(inner, "share_embeddings_and_output_weights", True):
        return None
    return inner.shared_embedding_or_output_weight()


def _allreduce_embedding_grads(model: list[torch.nn.Module], pg_collection) -> None:
    """NOTE [ Gradient finalization ], rule 3 (no-op unless pp > 1 and this rank holds a copy)."""
    pp_group = _group(pg_collection, "pp", parallel_state.get_pipeline_model_parallel_group)
    if dist.get_world_size(pp_group) == 1:
        return
    if pg_collection is not None and getattr(pg_collection, "embd", None) is not None:
        group = pg_collection.embd
    else:
        if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
            return
        group = parallel_state.get_embedding_group()
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = []
    for chunk in (model[0], model[-1]) if len(model) > 1 else (model[0],):
        weight = _embedding_weight(chunk)
        if weight is not None and _grad(weight) is not None:
            grads.append(_grad(weight))
    if not grads:  # a model without tied embeddings (or without shared_embedding_or_output_weight)
        return
    if len(grads) > 1:
        # One copy per rank: the first stage's chunk 0 or the last stage's last chunk.
        raise MegatronCoreError(
            f"finalize_model_grads: expected one tied-embedding copy on this rank, found "
            f"{len(grads)}"
        )
    _flat_all_reduce(grads, group, None)


def _update_router_expert_bias(model: list[torch.nn.Module], config) -> None:
    """NOTE [ Gradient finalization ], rule 7: one balancing step of every router's bias."""
    counts, biases = [], []
    for chunk in model:
        for module in chunk.modules():
            if hasattr(module, "expert_bias") and module.expert_bias is not None:
                counts.append(module.local_tokens_per_expert)
                biases.append(module.expert_bias)
    if not biases:  # a model whose MoE layers are on other stages, or none
        return
    with torch.no_grad():
        total = torch.stack(counts).to(torch.float32)
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        consistency.checked_all_reduce("finalize_model_grads expert tokens", total, group)
        offset = total.mean(dim=-1, keepdim=True) - total
        step = torch.sign(offset) * config.moe_router_bias_update_rate
        for bias, change in zip(biases, step):
            bias.add_(change.to(bias.dtype))


def _update_router_qb_beta(model: list[torch.nn.Module], config, dp_cp_group=None) -> None:
    """NOTE [ Gradient finalization ], rule 7: one quantile-balancing step of every router.

    For each training module of ``model`` with a ``qb_beta_accum`` ([num_experts] fp32 sum of the
    per-microbatch quantiles) and ``qb_beta_count`` (how many were summed), the mean quantile is
    averaged over ``dp_cp_group`` (parallel_state's data x context group when None), and
    ``qb_beta`` becomes ``ema * qb_beta + (1 - ema) * mean`` minus its mean over experts, in
    place. One all-reduce of the stacked [routers, num_experts] means; none without routers.
    """
    routers = [
        module
        for chunk in model
        for module in get_attr_wrapped_model(chunk, "modules")()
        if getattr(module, "qb_beta_accum", None) is not None and module.training
    ]
    if not routers:
        return
    if dp_cp_group is None:
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    with torch.no_grad():
        means = torch.stack(
            [
                r.qb_beta_accum / r.qb_beta_count.clamp(min=1).to(r.qb_beta_accum.dtype)
                for r in routers
            ]
        )
        consistency.checked_all_reduce("finalize_model_grads router quantiles", means, dp_cp_group)
        means.div_(get_pg_size(dp_cp_group))
        ema = config.moe_router_quantile_balancing_ema
        for router, mean in zip(routers, means):
            blended = ema * router.qb_beta + (1.0 - ema) * mean.to(router.qb_beta.dtype)
            router.qb_beta.copy_(blended - blended.mean(dim=-1, keepdim=True))


def _finish_grad_sync(chunk, force_all_reduce) -> None:
    """A DDP wrapper's data-parallel reduction (rule 6), passing ``force_all_reduce`` where its
    ``finish_grad_sync`` takes it (megatron-core 0.16.1's does)."""
    if "force_all_reduce" in inspect.signature(chunk.finish_grad_sync).parameters:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    else:
        chunk.finish_grad_sync()


def _allreduce_tensor_parallel_replicas(chunk: torch.nn.Module, tp_group) -> None:
    """NOTE [ Gradient finalization ], rule 5."""
    if dist.get_world_size(tp_group) == 1:
        return
    config = getattr(chunk, "config", None)
    qk_layernorm = bool(getattr(config, "qk_layernorm", False))
    summed, averaged = [], []
    for name, param in chunk.named_parameters():
        if not param.requires_grad or _grad(param) is None:
            continue
        if getattr(param, "average_gradients_across_tp_domain", False):
            averaged.append(_grad(param))
        elif getattr(param, "sequence_parallel", False):
            continue  # rule 1 summed it already
        elif qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name):
            summed.append(_grad(param))
    if summed:
        _flat_all_reduce(summed, tp_group, None)
    if averaged:
        _flat_all_reduce(averaged, tp_group, 1 / dist.get_world_size(tp_group))


def _allreduce_data_parallel_grads(chunk, dp_group, pg_collection, average: bool) -> None:
    """NOTE [ Gradient finalization ], rule 2, for a chunk without a DDP wrapper."""
    dp_size = dist.get_world_size(dp_group)
    scale = 1 / dp_size if average else None
    dense, expert = [], []
    for param in chunk.parameters():
        if _grad(param) is not None:
            (expert if getattr(param, "allreduce", True) is False else dense).append(_grad(param))
    if dense and dp_size > 1:
        _flat_all_reduce(dense, dp_group, scale)
    if expert:
        expert_dp_group = _group(
            pg_collection, "expt_dp", parallel_state.get_expert_data_parallel_group
        )
        if dist.get_world_size(expert_dp_group) > 1:
            _flat_all_reduce(expert, expert_dp_group, scale)
        elif scale is not None and scale != 1:
            for grad in expert:
                grad.mul_(scale)


# --- megatron-core's private reductions, by name (see NOTE rule 8) ---------------------------


def _stage_chunk(model: list[torch.nn.Module], pp_group, config) -> torch.nn.Module:
    """The chunk holding this rank's word-embedding copy: the first chunk on the first stage,
    the last on the last stage (or wherever MTP layers put it), else the first."""
    pp_size = dist.get_world_size(pp_group) if pp_group is not None else 1
    pp_rank = dist.get_rank(pp_group) if pp_group is not None else 0
    if pp_rank == 0:
        return model[0]
    if pp_rank == pp_size - 1 or (getattr(config, "mtp_num_layers", None) or 0) > 0:
        return model[-1]
    return model[0]


def _allreduce_word_embedding_grads(
    model: list[torch.nn.Module], config, embd_group=None, pp_group=None
) -> None:
    """Sum the tied word embedding's gradient over the embedding group (NOTE rule 3, rule 8).

    Only ranks of ``embd_group`` with more than one rank take part. The copy is read from the
    chunk :func:`_stage_chunk` names (unwrapped to the module with ``pre_process``) where it
    shares the output weight or ``config.mtp_num_layers`` is set; a missing weight or gradient
    (a frozen embedding) is skipped. ``main_grad`` is reduced where the parameter has one.

    Args:
        model: this rank's model chunks.
        config: the model's TransformerConfig.
        embd_group: the embedding group; None reads parallel_state's (and then ``pp_group``
            must be None too: it is read from parallel_state).
        pp_group: the pipeline group, to find this rank's stage.
    """
    if embd_group is None:
        embd_group = parallel_state.get_embedding_group(check_initialized=False)
        if get_pg_size(embd_group) > 1:
            if pp_group is not None:
                raise MegatronCoreError(
                    "_allreduce_word_embedding_grads: pp_group was given without embd_group; "
                    "pass both or neither (neither: both come from parallel_state)"
                )
            pp_group = parallel_state.get_pipeline_model_parallel_group()
    if get_pg_size(embd_group) <= 1 or dist.get_rank() not in dist.get_process_group_ranks(
        embd_group
    ):
        return
    chunk = _stage_chunk(model, pp_group, config)
    chunk = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    if not (tied or getattr(config, "mtp_num_layers", 0)):
        return
    weight = chunk.shared_embedding_or_output_weight()
    grad = None if weight is None else _grad(weight)
    if grad is not None:
        _flat_all_reduce([grad], embd_group, None)


def _allreduce_non_tensor_model_parallel_grads(
    model: list[torch.nn.Module], config, tp_group=None
) -> None:
    """Reduce the gradients of TP-replicated parameters over the TP group (NOTE rules 1, 5, 8).

    For every trainable parameter with a gradient: averaged when it is marked
    ``average_gradients_across_tp_domain``; else summed when ``config.sequence_parallel`` and
    it is marked ``sequence_parallel``, or when ``config.qk_layernorm`` and its name contains
    ``q_layernorm`` / ``k_layernorm``. Nothing happens on a one-rank group.

    Args:
        model: this rank's model chunks.
        config: the model's TransformerConfig (reads ``sequence_parallel``, ``qk_layernorm``).
        tp_group: the tensor-parallel group; None reads parallel_state's.
    """
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if get_pg_size(tp_group) <= 1:
        return
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    qk_layernorm = bool(getattr(config, "qk_layernorm", False))
    summed, averaged = [], []
    for chunk in model:
        for name, param in get_attr_wrapped_model(chunk, "named_parameters")():
            if not param.requires_grad or _grad(param) is None:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                averaged.append(_grad(param))
            elif (sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            ):
                summed.append(_grad(param))
    if summed:
        _flat_all_reduce(summed, tp_group, None)
    if averaged:
        _flat_all_reduce(averaged, tp_group, 1 / get_pg_size(tp_group))


# megatron-core's older name of the helper above (0.16.1 and 0.19 keep it)
_allreduce_layernorm_grads = _allreduce_non_tensor_model_parallel_grads


def _allreduce_conditional_embedding_grads(
    model: list[torch.nn.Module], config, pp_group=None
) -> None:
    """Sum the gradients of embedders replicated on every pipeline stage (NOTE rule 8).

    Only with ``config.has_cond_embedder`` and more than one stage. Parameters marked
    ``pipeline_parallel = True`` (a diffusion model's timestep or label embedder, one copy per
    chunk) are matched across this rank's chunks by name: their gradients are added up, summed
    over ``pp_group``, and the total is written to every chunk's copy.

    Args:
        model: this rank's model chunks (several with virtual pipelining).
        config: the model's config (reads ``has_cond_embedder``).
        pp_group: the pipeline group; None reads parallel_state's.
    """
    if pp_group is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    if get_pg_size(pp_group) <= 1 or not getattr(config, "has_cond_embedder", False):
        return
    copies: dict[str, list[torch.Tensor]] = {}
    for chunk in model:
        for name, param in get_attr_wrapped_model(chunk, "named_parameters")():
            if param.requires_grad and getattr(param, "pipeline_parallel", False):
                if _grad(param) is not None:
                    copies.setdefault(name, []).append(_grad(param))
    if not copies:
        return
    totals = [grads[0] for grads in copies.values()]
    for grads in copies.values():
        for other in grads[1:]:
            grads[0].add_(other)
    _flat_all_reduce(totals, pp_group, None)
    for grads in copies.values():
        for other in grads[1:]:
            other.copy_(grads[0])


def finalize_model_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
) -> None:
    """Reduce gradients across TP (SP params), DP and the embedding group, in place.

    See NOTE [ Gradient finalization ]. Call on every rank after the schedule's last backward
    (schedules call it through ``config.finalize_model_grads_func``).

    Args:
        model: this rank's model chunks (a list, as the schedules pass it).
        num_tokens: tokens this step's loss was summed over (a 0-dim int tensor on the last
            stage), or None for a loss already averaged per microbatch.
        pg_collection: optional object with ``tp``, ``pp``, ``dp_cp`` and ``embd`` groups; absent
            groups come from parallel_state.
        force_all_reduce: passed to a DDP wrapper's ``finish_grad_sync`` (all-reduce instead of
            the distributed optimizer's reduce-scatter); plain chunks always all-reduce.
    """
    if isinstance(model, torch.nn.Module):
        model = [model]
    consistency.note_iteration("finalize")  # a loop without the schedules (NOTE [ Check window ])
    tp_group = _group(pg_collection, "tp", parallel_state.get_tensor_model_parallel_group)
    dp_group = _group(
        pg_collection,
        "dp_cp",
        lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    for chunk in model:  # rule 6: a DDP wrapper's reduction first
        if hasattr(chunk, "finish_grad_sync"):
            _finish_grad_sync(chunk, force_all_reduce)
    for chunk in model:  # rules 1 and 5
        allreduce_sequence_parallel_grads(chunk, tp_group)
        _allreduce_tensor_parallel_replicas(chunk, tp_group)
    for chunk in model:  # rule 2
        if not hasattr(chunk, "finish_grad_sync"):
            _allreduce_data_parallel_grads(chunk, dp_group, pg_collection, num_tokens is None)
    _allreduce_embedding_grads(model, pg_collection)  # rule 3
    config = getattr(model[0], "config", None)
    if config is not None:  # rule 7
        if getattr(config, "moe_router_enable_expert_bias", False):
            _update_router_expert_bias(model, config)
        if getattr(config, "moe_router_load_balancing_type", None) == "quantile_balancing":
            _update_router_qb_beta(model, config, dp_group)
        reset_model_temporary_tensors(config, model)
    if num_tokens is not None:  # rule 4
        pp_group = _group(pg_collection, "pp", parallel_state.get_pipeline_model_parallel_group)
        ranks = dist.get_process_group_ranks(pp_group)
        count = num_tokens.detach().to(dtype=torch.float32, device=_device_of(model)).reshape(())
        dist.broadcast(count, src=ranks[-1], group=pp_group)
        consistency.checked_all_reduce("finalize_model_grads num_tokens", count, dp_group)
        scale = 1.0 / max(count.item(), 1.0)
        for chunk in model:
            if hasattr(chunk, "scale_gradients"):  # a DDP wrapper scales its buffers
                chunk.scale_gradients(scale)
                continue
            for p in chunk.parameters():
                if _grad(p) is not None:
                    _grad(p).mul_(scale)


def _device_of(model: list[torch.nn.Module]) -> torch.device:
    for chunk in model:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def reset_model_temporary_tensors(config, model: list[torch.nn.Module]) -> None:
    """Clear the per-step MoE router statistics of every module of ``model`` (0.16.1 semantics).

    For each chunk (unwrapped to the object with ``modules``), every module that has an
    ``expert_bias`` gets its ``local_tokens_per_expert`` zeroed in place when
    ``config.moe_router_enable_expert_bias``; every module with ``reset_global_aux_loss_tracker``
    has it called when ``config.moe_router_load_balancing_type`` is or contains
    "global_aux_loss"; every module with a ``qb_beta_accum`` (0.19's quantile balancing) has it
    and its ``qb_beta_count`` zeroed. A config without these MoE fields (a plain
    ModelParallelConfig) resets nothing. No collective runs.

    Args:
        config: the model's TransformerConfig.
        model: this rank's model chunks.
    """
    expert_bias = getattr(config, "moe_router_enable_expert_bias", False)
    balancing = getattr(config, "moe_router_load_balancing_type", "") or ""
    global_aux = balancing == "global_aux_loss" or "global_aux_loss" in balancing
    for chunk in model:
        for module in get_attr_wrapped_model(chunk, "modules")():
            if expert_bias and hasattr(module, "expert_bias"):
                module.local_tokens_per_expert.zero_()
            if global_aux and hasattr(module, "reset_global_aux_loss_tracker"):
                module.reset_global_aux_loss_tracker()
            if getattr(module, "qb_beta_accum", None) is not None:
                module.qb_beta_accum.zero_()
                module.qb_beta_count.zero_()
