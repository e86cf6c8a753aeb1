"""VocabParallelEmbedding: an embedding table split along the vocabulary (re-exported by
``layers.py``, megatron-core's import path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import consistency
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel.layer_params import (
    _check_divisible,
    _init_shard,
    _new_param,
    _resolve_tp_group,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_core.tensor_parallel.sharded_state import sharded_state_dict_of_layer
from megatron_core.tensor_parallel.utils import VocabUtility

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding split along the vocabulary: rank r holds rows [r V/p, (r+1) V/p).

    Each rank looks up the ids in its range (others read row 0 and are zeroed), then the partial
    embeddings are summed over the group (g: all-reduce forward, identity backward). With
    ``reduce_scatter_embeddings`` the [b, s, h] result is transposed to [s, b, h] and
    reduce-scattered along the sequence instead, as megatron-core's LanguageModelEmbedding does
    under sequence parallelism.

    Args:
        num_embeddings: vocabulary size; a multiple of the TP size.
        embedding_dim: hidden size.
        init_method: fills a weight tensor in place.
        reduce_scatter_embeddings: reduce-scatter to [s/tp, b, h] instead of all-reducing.
        config: the ModelParallelConfig to read options from.
        tp_group: tensor-parallel group; default parallel_state's. The layer's TP size is this
            group's size.

    Raises:
        MegatronCoreError: num_embeddings not divisible by the TP size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        layer = "VocabParallelEmbedding"
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.deterministic_mode = config.deterministic_mode
        self.tp_group, self.tp_rank, self.tp_size = _resolve_tp_group(layer, tp_group)
        _check_divisible(
            layer, "num_embeddings", num_embeddings, "tensor-parallel size", self.tp_size
        )
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(
                num_embeddings, self.tp_rank, self.tp_size
            )
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _new_param(config, self.num_embeddings_per_partition, embedding_dim)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        full_shape = (num_embeddings, embedding_dim)
        _init_shard(self.weight, config, init_method, full_shape, 0, 1, self.tp_rank, self.tp_size)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None) -> dict:
        """megatron-core's dist_checkpointing view: the weight split over TP along the vocab
        (shape mismatches allowed, for a vocab padded differently at another TP size). See
        NOTE [ Sharded state dict ] in tensor_parallel/sharded_state.py."""
        return sharded_state_dict_of_layer(
            self, prefix, {"weight": 0}, sharded_offsets, metadata, allow_shape_mismatch=True
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Embed the ids ``input_`` [b, s]: [b, s, h], or [s/tp, b, h] when reduce-scattering.

        Ids outside [0, num_embeddings) raise a MegatronCoreError (``consistency.check_ids``),
        in the window and after it; in check mode and the default window ids that differ
        between the ranks of the group also raise, on every rank, and after the window the
        iteration's digest does (NOTE [ Check window ]). Only with the checks off
        (``consistency.set_mode("off")``) does an id outside every rank's range embed to zeros
        (megatron-core's behaviour).
        """
        consistency.check_ids("VocabParallelEmbedding", self.tp_group, input_, self.num_embeddings)
        if self.tp_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local_ids = input_
        if self.deterministic_mode:
            output_parallel = self.weight[local_ids]
        else:
            output_parallel = F.embedding(local_ids, self.weight)
        if self.tp_size > 1:
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, TP={self.tp_size}, "
            f"rows=[{self.vocab_start_index}, {self.vocab_end_index})"
        )
