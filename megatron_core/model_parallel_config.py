"""ModelParallelConfig: the options the parallel layers read (megatron-core's name and fields).

A subset of ``megatron.core.ModelParallelConfig``: the fields this package honours plus
megatron-core's common parallelism and precision fields, with megatron-core's names and defaults,
so ``ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)`` means the same
thing in both. Validation runs in ``__post_init__`` and raises
:class:`~megatron_core.errors.MegatronCoreError` naming the values.

One deliberate difference: megatron-core raises for ``sequence_parallel=True`` with
``tensor_model_parallel_size=1``; here sequence parallelism is switched off with a warning (it is
a no-op on one rank), as megatron-core's layers themselves do for a one-rank group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_core.errors import MegatronCoreError

__all__ = ["ModelParallelConfig"]

_SIZE_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)


@dataclass
class ModelParallelConfig:
    """Parallelism, initialization and precision options shared by the tensor-parallel layers.

    Attributes:
        tensor_model_parallel_size: ranks that split each layer's weights (intra-layer). The
            layers check it against the size of the tensor-parallel group they use.
        pipeline_model_parallel_size: pipeline stages (inter-layer parallelism).
        virtual_pipeline_model_parallel_size: model chunks per pipeline stage (interleaved
            schedule), or None.
        sequence_parallel: split LayerNorm/dropout activations along the sequence dimension
            across the tensor-parallel group (Korthikanti et al., arXiv:2205.05198). Linear
            layers then all-gather their input / reduce-scatter their output along dim 0.
            Switched off with a warning when tensor_model_parallel_size is 1.
        context_parallel_size: ranks that split the sequence for attention.
        expert_model_parallel_size: ranks that split the experts of MoE layers.
        perform_initialization: run ``init_method`` on new weights (and zero the biases). Turn
            off when the weights are loaded from a checkpoint anyway.
        use_cpu_initialization: draw each full (output, input) master weight on the CPU and keep
            this rank's slice: the full weight is the same for every TP size. When False each
            rank draws its shard on the current device inside the "model-parallel-rng" stream.
        fp16: train with fp16 mixed precision.
        bf16: train with bf16 mixed precision.
        params_dtype: dtype of the weights the layers create.
        pipeline_dtype: dtype of pipeline point-to-point tensors; required when
            pipeline_model_parallel_size > 1 (as in megatron-core).
        timers: megatron-style timers object, or None; kept for compatibility, unused here.
        deterministic_mode: prefer deterministic kernels (the embedding gathers rows by
            indexing instead of F.embedding, whose backward may be non-deterministic on GPUs).
        gradient_accumulation_fusion: linear layers add their weight gradient into the fp32
            ``weight.main_grad`` buffer (which the caller creates, as megatron's DDP does)
            instead of producing ``weight.grad``; apex's fused kernel is used when available.
        async_tensor_model_parallel_allreduce: in ColumnParallelLinear's backward, overlap the
            all-reduce of the input gradient with the weight-gradient matmul (instead of a
            synchronous all-reduce after it). Ignored under sequence parallelism, where the
            reduce-scatter of the input gradient is always overlapped. True by default:
            megatron-core 0.16 always overlaps (it has no switch).
    """

    # Model parallelism.
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1

    # Initialization.
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    # Training.
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    pipeline_dtype: torch.dtype | None = None
    timers: Callable | None = None
    deterministic_mode: bool = False

    # Optimizations.
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = True

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MegatronCoreError(f"ModelParallelConfig: {name} ({value!r}) must be >= 1")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (self.pipeline_model_parallel_size < 2 or vpp < 1):
            raise MegatronCoreError(
                f"ModelParallelConfig: virtual_pipeline_model_parallel_size ({vpp}) needs "
                f"pipeline_model_parallel_size ({self.pipeline_model_parallel_size}) > 1"
            )
        if self.fp16 and self.bf16:
            raise MegatronCoreError("ModelParallelConfig: fp16 and bf16 cannot both be True")
        if not isinstance(self.params_dtype, torch.dtype):
            raise MegatronCoreError(
                f"ModelParallelConfig: params_dtype ({self.params_dtype!r}) must be a torch.dtype"
            )
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise MegatronCoreError(
                f"ModelParallelConfig: pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) > 1 needs pipeline_dtype to be set"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn(
                "ModelParallelConfig: sequence_parallel is True but tensor_model_parallel_size "
                "is 1; disabling sequence parallelism",
                stacklevel=3,
            )
            self.sequence_parallel = False
