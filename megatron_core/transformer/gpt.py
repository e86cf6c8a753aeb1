"""GPTModel: vocab-parallel embedding + learned positions + TransformerBlock + tied logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_core.tensor_parallel.layers import (
    VocabParallelEmbedding,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron_core.transformer.config import TransformerConfig
from megatron_core.transformer.layer import TransformerBlock, dropout_rng_context

__all__ = ["GPTModel"]


class GPTModel(torch.nn.Module):
    """A decoder-only language model built from the tensor-parallel layers.

    Data flow for tokens [b, s] (h = hidden size, V = vocab_size, tp = TP size):

    - VocabParallelEmbedding: each rank embeds the ids in its vocabulary range and the partial
      embeddings are summed over the group (all-reduce), or, under sequence parallelism,
      reduce-scattered along the sequence to this rank's [s/tp, b, h] part;
    - plus the learned position embeddings of those positions, then dropout;
    - TransformerBlock (layers and final LayerNorm) on [s, b, h] ([s/tp, b, h] under SP);
    - logits = hidden @ word_embeddings^T, this rank's [s, b, V/tp] columns (the output layer
      shares the word embedding's weight); under SP the hidden states are all-gathered first;
    - loss: ``vocab_parallel_cross_entropy``, per token, [b, s].

    Args:
        config: the model's TransformerConfig.
        vocab_size: V, already padded to a multiple of the TP size.
        max_sequence_length: rows of the position embedding.
        true_vocab_size: the vocabulary before padding (None: ``vocab_size``, megatron's
            behaviour). When smaller, the logits of the padding ids are -inf (the loss and the
            returned logits no longer depend on how much padding the TP size needed), and
            checkpoints store only the true rows of the embedding (the weight carries
            ``unpadded_partition_size``, read by megatron_core.training.checkpoint).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        true_vocab_size: int | None = None,
    ):
        super().__init__()
        if true_vocab_size is not None and not 0 < true_vocab_size <= vocab_size:
            raise MegatronCoreError(
                f"GPTModel: true_vocab_size ({true_vocab_size}) must be in [1, vocab_size "
                f"({vocab_size})]"
            )
        self.config = config
        self.vocab_size = vocab_size
        self.true_vocab_size = vocab_size if true_vocab_size is None else true_vocab_size
        self.max_sequence_length = max_sequence_length
        self.embedding = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            init_method=config.init_method,
            config=config,
            reduce_scatter_embeddings=config.sequence_parallel,
        )
        where = {} if config.use_cpu_initialization else {"device": device.current_device()}
        self.position_embeddings = torch.nn.Embedding(
            max_sequence_length, config.hidden_size, dtype=config.params_dtype, **where
        )
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.position_embeddings.weight)
        # Under SP each rank uses only its positions: the gradient is partial (all-reduce it).
        self.position_embeddings.weight.sequence_parallel = config.sequence_parallel
        self.decoder = TransformerBlock(config)
        if self.true_vocab_size < vocab_size:
            self.embedding.weight.unpadded_partition_size = self.true_vocab_size

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        words = self.embedding(input_ids)  # [b, s, h], or [s/tp, b, h] under SP
        positions = self.position_embeddings.weight[:s]
        if self.config.sequence_parallel:
            part = words.shape[0]
            start = parallel_state.get_tensor_model_parallel_rank() * part
            positions = positions[start : start + part]
        else:
            # Contiguous [s, b, h]: a strided layout would follow the hidden states into every
            # layer, and a full-recompute checkpoint's input .grad (which takes its input's
            # strides) would then reduce the bias gradients in another order than without it.
            words = words.transpose(0, 1).contiguous()
        embeddings = words + positions.unsqueeze(1)
        with dropout_rng_context(self.config):  # NOTE [ Dropout streams ] in layer.py
            return F.dropout(embeddings, p=self.config.hidden_dropout, training=self.training)

    def _check_input(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> None:
        if input_ids.dim() != 2:
            raise MegatronCoreError(
                f"GPTModel: input_ids must be [batch, sequence], got shape {tuple(input_ids.shape)}"
            )
        s, tp = input_ids.shape[1], self.config.tensor_model_parallel_size
        if s > self.max_sequence_length:
            raise MegatronCoreError(
                f"GPTModel: sequence length ({s}) exceeds max_sequence_length "
                f"({self.max_sequence_length})"
            )
        if self.config.sequence_parallel and s % tp:
            raise MegatronCoreError(
                f"GPTModel: sequence length ({s}) must be divisible by "
                f"tensor_model_parallel_size ({tp}) under sequence parallelism"
            )
        if labels is not None and labels.shape != input_ids.shape:
            raise MegatronCoreError(
                f"GPTModel: labels shape {tuple(labels.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf at the ids >= true_vocab_size in this rank's vocabulary columns [.., V/tp]."""
        if self.true_vocab_size == self.vocab_size:
            return logits
        part = logits.shape[-1]
        first = parallel_state.get_tensor_model_parallel_rank() * part
        ids = torch.arange(first, first + part, device=logits.device)
        return logits.masked_fill(ids >= self.true_vocab_size, float("-inf"))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model.

        Args:
            input_ids: token ids [b, s], the same on every rank of the TP group.
            labels: next-token ids [b, s], or None.

        Returns:
            The fp32 loss of every token [b, s] when ``labels`` is given, else this rank's
            vocab-parallel logits [b, s, V/tp].
        """
        self._check_input(input_ids, labels)
        hidden = self.decoder(self._embed(input_ids))
        sequence_parallel = self.config.sequence_parallel
        logits = linear_with_grad_accumulation_and_async_allreduce(
            hidden,
            self.embedding.weight,
            None,
            gradient_accumulation_fusion=False,
            allreduce_dgrad=self.config.tensor_model_parallel_size > 1 and not sequence_parallel,
            sequence_parallel=sequence_parallel,
        )  # [s, b, V/tp]
        logits = self._mask_padding(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1))
        return loss.transpose(0, 1).contiguous()
