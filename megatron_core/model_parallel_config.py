"""ModelParallelConfig: megatron-core 0.16's configuration dataclass, every field and default.

All 67 fields of ``megatron.core.ModelParallelConfig`` (0.16.1) in its order with its defaults, so
code that builds one for megatron-core builds one here. ``__post_init__`` fills the derived
defaults and validates as megatron-core does; a bad value raises :class:`ConfigError` (a
``ValueError``, which megatron-core raises, and a
:class:`~megatron_core.errors.MegatronCoreError`) naming the values.

What this package reads (the other fields are accepted, validated and carried for code that reads
them, with no effect inside megatron_core):

- parallel sizes: ``tensor_model_parallel_size`` (the transformer; the tensor-parallel layers
  size themselves from their process group), ``pipeline_model_parallel_size``,
  ``virtual_pipeline_model_parallel_size``, ``sequence_parallel``, ``context_parallel_size``,
  ``expert_model_parallel_size``, ``expert_tensor_parallel_size``;
- initialization: ``perform_initialization``, ``use_cpu_initialization``, ``params_dtype``;
- precision: ``fp16``, ``bf16``, ``enable_autocast``, ``autocast_dtype``;
- layers: ``deterministic_mode``, ``gradient_accumulation_fusion`` (apex's kernel when present,
  else an identical torch fallback), ``defer_embedding_wgrad_compute``, ``wgrad_deferral_limit``;
- pipeline: ``pipeline_dtype``, ``variable_seq_lengths``, ``batch_p2p_comm``,
  ``overlap_p2p_comm``, ``deallocate_pipeline_outputs``, ``microbatch_group_size_per_vp_stage``,
  ``finalize_model_grads_func``, ``grad_scale_func``, ``no_sync_func``, ``grad_sync_func``,
  ``param_sync_func``, ``timers``.

Fields for Transformer Engine features (``tp_comm_*`` userbuffer overlap, ``use_te_rng_tracker``,
``cross_entropy_fusion_impl='te'``, CPU offloading) and for MoE/MTP schedules are accepted and
documented as having no effect here. ``async_tensor_model_parallel_allreduce`` and
``moe_extended_tp`` are ignored, as in megatron-core.

megatron-core 0.17-0.19's fields follow, after all of 0.16.1's (which keep its positional order):
``tensor_parallel_num_weight_shards`` / ``expert_tensor_parallel_num_weight_shards`` resolve
``gtp_weight_remat_size`` / ``expert_gtp_weight_remat_size`` as 0.19 does, and a remat size above
1 (generalized tensor parallelism, not implemented here) raises ``ConfigError`` naming the field;
``moe_grad_scale_func``, ``mtp_grad_scale_func``, ``overlap_dispatch_backward_with_experts_wgrad``
and ``cpu_offloading_retain_pinned_cpu_buffers`` are carried for megatron-core's model code.

One deliberate difference: megatron-core raises for ``sequence_parallel=True`` with
``tensor_model_parallel_size=1``; here sequence parallelism is switched off with a warning (it is
a no-op on one rank), as megatron-core's layers themselves do for a one-rank group.
"""

# No ``from __future__ import annotations``: dataclass fields keep their real types, as in
# megatron-core, for tools that read them (megatron's argparse builder, argument_utils.py).
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_core.errors import ConfigError

__all__ = [
    "ModelParallelConfig",
    "ConfigError",
    "resolve_tensor_parallel_weight_shards",
    # extension: the one refusal of generalized TP (0.19), used wherever its options appear
    "check_gtp_size",
]

_SIZE_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)
_CHOICES = {
    "pipeline_model_parallel_comm_backend": (None, "nccl", "ucc"),
    "cross_entropy_fusion_impl": ("native", "te"),
    "tp_comm_bootstrap_backend": ("nccl", "mpi", "gloo"),
}


def check_gtp_size(option: str, value) -> None:
    """The one refusal of generalized tensor parallelism (megatron-core 0.19's weight
    rematerialization, where each weight is sharded again over a "gtp remat" group and
    re-gathered around every use): every option naming a remat size accepts 1 (off, 0.19's
    default); anything else raises here, before any collective. ``option`` names the argument.

    Raises:
        ConfigError: ``value`` is not 1, e.g. ``gtp_remat_size (2) > 1: generalized tensor
            parallelism ... is not implemented``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{option} ({value!r}) must be a positive int (1: no weight remat)")
    if value != 1:
        raise ConfigError(
            f"{option} ({value}) > 1: generalized tensor parallelism (megatron-core 0.19's "
            "weight rematerialization) is not implemented in megatron_core; use 1"
        )


def resolve_tensor_parallel_weight_shards(
    tensor_model_parallel_size: int,
    tensor_parallel_num_weight_shards: int | None,
    gtp_weight_remat_size: int,
    shards_field: str = "tensor_parallel_num_weight_shards",
    tp_field: str = "tensor_model_parallel_size",
) -> tuple[int, int]:
    """Reconcile the number of weight shards with the generalized-TP remat size (0.19).

    The shards are ``tensor_model_parallel_size * gtp_weight_remat_size``; when
    ``tensor_parallel_num_weight_shards`` is given it decides the remat size, else it is computed
    from it. Idempotent.

    Args:
        tensor_model_parallel_size: the (expert) tensor-parallel size.
        tensor_parallel_num_weight_shards: total shards per weight, or None.
        gtp_weight_remat_size: the remat size used when the shards are None.
        shards_field, tp_field: the names the error message uses.

    Returns:
        ``(tensor_parallel_num_weight_shards, gtp_weight_remat_size)``.

    Raises:
        ConfigError: the shards are fewer than, or not a multiple of, the TP size.
    """
    tp = tensor_model_parallel_size
    if tensor_parallel_num_weight_shards is None:
        return tp * gtp_weight_remat_size, gtp_weight_remat_size
    if tensor_parallel_num_weight_shards < tp or tensor_parallel_num_weight_shards % tp:
        raise ConfigError(
            f"{shards_field} ({tensor_parallel_num_weight_shards}) must be a multiple of "
            f"{tp_field} ({tp}), at least 1x"
        )
    return tensor_parallel_num_weight_shards, tensor_parallel_num_weight_shards // tp


@dataclass
class ModelParallelConfig:
    """Parallelism, initialization, precision and pipeline options (megatron-core's fields).

    Field meanings are megatron-core's; the module docstring says which ones this package acts
    on. The main ones:

    Attributes:
        tensor_model_parallel_size: ranks that split each layer's weights (intra-layer).
        pipeline_model_parallel_size: pipeline stages (inter-layer parallelism).
        virtual_pipeline_model_parallel_size: model chunks per stage (interleaved schedule).
        sequence_parallel: split LayerNorm/dropout activations along the sequence across the
            TP group (Korthikanti et al., arXiv:2205.05198); linear layers then all-gather
            their input / reduce-scatter their output along dim 0.
        context_parallel_size: ranks that split the sequence for attention.
        expert_model_parallel_size: ranks that split the experts of MoE layers.
        expert_tensor_parallel_size: TP size inside an expert; None means
            tensor_model_parallel_size (set in __post_init__).
        perform_initialization: run ``init_method`` on new weights (and zero the biases).
        use_cpu_initialization: draw each full master weight on the CPU and keep this rank's
            slice (the same full weight for every TP size); else each rank draws its shard on
            its device in the "model-parallel-rng" stream.
        params_dtype: dtype of the weights the layers create.
        autocast_dtype: dtype for ``enable_autocast``; None means params_dtype.
        gradient_accumulation_fusion: linear layers add their weight gradient into the fp32
            ``weight.main_grad`` (which the caller creates) instead of ``weight.grad``.
        defer_embedding_wgrad_compute / wgrad_deferral_limit: the output layer stashes its
            inputs and output gradients for the caller to compute its weight gradient later
            (needs pipeline parallelism and gradient_accumulation_fusion, as in megatron-core).
        pipeline_dtype: dtype of pipeline point-to-point tensors; required when
            pipeline_model_parallel_size > 1.
        microbatch_group_size_per_vp_stage: microbatches run per virtual stage at a time;
            None means pipeline_model_parallel_size (set in __post_init__).
    """

    # Model parallelism.
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_comm_backend: Literal["nccl", "ucc"] | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: list[int] | None = None
    max_seqlen_per_dp_cp_rank: int | None = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    moe_extended_tp: bool = False  # deprecated in megatron-core 0.10 and ignored there too

    # Initialization.
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    # Training.
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    timers: Callable | None = None
    finalize_model_grads_func: Callable | None = None
    grad_scale_func: Callable | None = None
    no_sync_func: Callable | None = None
    grad_sync_func: Callable | None = None
    param_sync_func: Callable | None = None
    deterministic_mode: bool = False
    enable_autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    num_microbatches_with_partial_activation_checkpoints: int | None = None

    # Optimizations (tp_comm_*: Transformer Engine userbuffers, no effect here).
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = True  # deprecated and ignored (megatron-core)
    use_te_rng_tracker: bool = False
    tp_comm_overlap: bool = False
    tp_comm_bulk_wgrad: bool = True
    tp_comm_bulk_dgrad: bool = True
    tp_comm_overlap_ag: bool = True
    tp_comm_overlap_rs: bool = True
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_split_ag: bool = True
    tp_comm_atomic_ag: bool = False
    tp_comm_split_rs: bool = True
    tp_comm_atomic_rs: bool = False
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    tp_comm_overlap_disable_qkv: bool = False
    tp_comm_overlap_disable_fc1: bool = False
    tp_comm_bootstrap_backend: Literal["nccl", "mpi", "gloo"] = "nccl"
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    ep_overlap_early_attn_memory_release: bool = False

    # Pipeline parallelism.
    pipeline_dtype: torch.dtype = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    deallocate_pipeline_outputs: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    overlap_p2p_comm_warmup_flush: bool = False
    microbatch_group_size_per_vp_stage: int | None = None
    mtp_standalone: bool = False

    # CPU offloading (a Transformer Engine feature in megatron-core; no effect here).
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    _cpu_offloading_context: AbstractContextManager | None = None  # internal in megatron-core
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False

    # Timing.
    barrier_with_L1_time: bool = True

    # megatron-core 0.17-0.19 fields, after all of 0.16.1's so its positional order holds.
    tensor_parallel_num_weight_shards: int | None = None
    gtp_weight_remat_size: int = 1
    expert_tensor_parallel_num_weight_shards: int | None = None
    expert_gtp_weight_remat_size: int = 1
    moe_grad_scale_func: Callable | None = None
    mtp_grad_scale_func: Callable | None = None
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False

    def __post_init__(self) -> None:
        self._check_values()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(
                "ModelParallelConfig: sequence_parallel=True needs tensor_model_parallel_size > 1 "
                "(got 1); sequence parallelism splits activations across tensor-parallel ranks "
                "(megatron-core 0.16 raises here too)"
            )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        self._resolve_weight_shards()
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ConfigError(
                f"ModelParallelConfig: pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) > 1 needs pipeline_dtype to be set"
            )
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        self._check_wgrad_deferral()
        if (
            self.expert_model_parallel_size > 1
            and self.tensor_model_parallel_size > 1
            and not self.sequence_parallel
        ):
            warnings.warn(
                "ModelParallelConfig: expert parallelism with tensor parallelism needs "
                "sequence_parallel for training (as in megatron-core)",
                stacklevel=3,
            )
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
        if self.overlap_p2p_comm_warmup_flush and (
            not self.overlap_p2p_comm or self.batch_p2p_comm
        ):
            raise ConfigError(
                "ModelParallelConfig: overlap_p2p_comm_warmup_flush (True) needs "
                f"overlap_p2p_comm=True (got {self.overlap_p2p_comm}) and batch_p2p_comm=False "
                f"(got {self.batch_p2p_comm})"
            )

    def _check_values(self) -> None:
        """Sizes, dtypes and choices that megatron-core would only trip over later."""
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelParallelConfig: {name} ({value!r}) must be >= 1")
        etp = self.expert_tensor_parallel_size
        if etp is not None and (isinstance(etp, bool) or not isinstance(etp, int) or etp < 1):
            raise ConfigError(
                f"ModelParallelConfig: expert_tensor_parallel_size ({etp!r}) must be >= 1 or None"
            )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (self.pipeline_model_parallel_size < 2 or vpp < 1):
            raise ConfigError(
                f"ModelParallelConfig: virtual_pipeline_model_parallel_size ({vpp}) needs "
                f"pipeline_model_parallel_size ({self.pipeline_model_parallel_size}) > 1"
            )
        if self.fp16 and self.bf16:
            raise ConfigError("ModelParallelConfig: fp16 and bf16 cannot both be True")
        for name in ("params_dtype", "autocast_dtype", "pipeline_dtype"):
            value = getattr(self, name)
            if not (value is None and name != "params_dtype") and not isinstance(
                value, torch.dtype
            ):
                raise ConfigError(f"ModelParallelConfig: {name} ({value!r}) must be a torch.dtype")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"ModelParallelConfig: {name} ({getattr(self, name)!r}) must be one of "
                    f"{choices}"
                )

    def _resolve_weight_shards(self) -> None:
        """0.19's ``*_num_weight_shards`` -> ``*_gtp_weight_remat_size``; a remat size above 1
        (generalized TP) raises, as it is not implemented here."""
        for prefix, tp_field in (
            ("", "tensor_model_parallel_size"),
            ("expert_", "expert_tensor_parallel_size"),
        ):
            shards_field = f"{prefix}tensor_parallel_num_weight_shards"
            remat_field = f"{prefix}gtp_weight_remat_size"
            shards = getattr(self, shards_field)
            _, remat = resolve_tensor_parallel_weight_shards(
                getattr(self, tp_field),
                shards,
                getattr(self, remat_field),
                shards_field=f"ModelParallelConfig: {shards_field}",
                tp_field=tp_field,
            )
            option = f"ModelParallelConfig: {remat_field}"
            if shards is not None:
                option += f" ({shards_field} {shards} / {tp_field} {getattr(self, tp_field)})"
            check_gtp_size(option, remat)
            setattr(self, remat_field, remat)

    def _check_wgrad_deferral(self) -> None:
        if not self.defer_embedding_wgrad_compute:
            return
        if self.pipeline_model_parallel_size == 1:
            raise ConfigError(
                "ModelParallelConfig: defer_embedding_wgrad_compute (True) needs "
                "pipeline_model_parallel_size > 1 (got 1)"
            )
        if not self.gradient_accumulation_fusion:
            raise ConfigError(
                "ModelParallelConfig: defer_embedding_wgrad_compute (True) needs "
                "gradient_accumulation_fusion=True"
            )
        if self.wgrad_deferral_limit < 0:
            raise ConfigError(
                f"ModelParallelConfig: wgrad_deferral_limit ({self.wgrad_deferral_limit}) must "
                "be >= 0"
            )
