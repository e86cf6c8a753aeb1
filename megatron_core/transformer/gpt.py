"""GPTModel: vocab-parallel embedding + learned positions + TransformerBlock + tied logits.

# NOTE [ Tied embeddings across stages ]
1. The output layer reuses the word embedding's weight (logits = hidden @ E^T). Without
   pipelining one parameter serves both.
2. Under pipeline parallelism the embedding lives on the first stage (``pre_process``) and the
   logits on the last (``post_process``), so the last stage holds a copy, also named
   ``embedding.weight`` (a VocabParallelEmbedding whose forward is never called) and marked
   ``shared = True`` / ``shared_embedding = True``.
3. At construction the copy is zeroed and all-reduced with the first stage's weight over the
   embedding group, so it starts equal (megatron-core does the same); after each backward
   ``finalize_model_grads`` sums the two gradients over that group, so both take the same step.
4. Gradient norms and parameter counts skip parameters marked ``shared`` so the tied weight
   counts once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import consistency, device, parallel_state
from megatron_core.context_parallel import cp_positions
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_core.tensor_parallel.layer_params import init_from_fp32_draw
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

    Under pipeline parallelism each stage (each virtual stage under interleaving) builds one
    chunk: the embeddings only where ``pre_process``, ``num_layers / (pp * vp)`` layers starting
    at global layer ``layer_offset``, and the final LayerNorm, logits and loss only where
    ``post_process`` (NOTE [ Tied embeddings across stages ]). A chunk that is not the first takes
    its input [s, b, h] through :meth:`set_input_tensor`; one that is not the last returns its
    hidden states [s, b, h] ([s/tp, b, h] under SP) for the next stage.

    Args:
        config: the model's TransformerConfig.
        vocab_size: V, already padded to a multiple of the TP size.
        max_sequence_length: rows of the position embedding.
        pre_process: this chunk holds the embeddings (megatron: first pipeline stage).
        post_process: this chunk holds the output layer and loss (last stage).
        vp_stage: the chunk's virtual pipeline stage under interleaving, else None.
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
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        true_vocab_size: int | None = None,
    ):
        super().__init__()
        if true_vocab_size is not None and not 0 < true_vocab_size <= vocab_size:
            raise MegatronCoreError(
                f"GPTModel: true_vocab_size ({true_vocab_size}) must be in [1, vocab_size "
                f"({vocab_size})]"
            )
        self.true_vocab_size = vocab_size if true_vocab_size is None else true_vocab_size
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.share_embeddings_and_output_weights = True
        if pre_process or post_process:
            self.embedding = VocabParallelEmbedding(
                vocab_size,
                config.hidden_size,
                init_method=config.init_method,
                config=config,
                reduce_scatter_embeddings=config.sequence_parallel,
            )
        if pre_process:
            where = {} if config.use_cpu_initialization else {"device": device.current_device()}
            self.position_embeddings = torch.nn.Embedding(
                max_sequence_length, config.hidden_size, dtype=config.params_dtype, **where
            )
            if config.perform_initialization:
                with torch.no_grad():
                    init_from_fp32_draw(config.init_method, self.position_embeddings.weight)
            # Under SP each rank uses only its positions: the gradient is partial (all-reduce it).
            self.position_embeddings.weight.sequence_parallel = config.sequence_parallel
        self.decoder = TransformerBlock(config, pre_process, post_process, vp_stage)
        self.layer_offset = self.decoder.layer_offset
        if (pre_process or post_process) and self.true_vocab_size < vocab_size:
            self.embedding.weight.unpadded_partition_size = self.true_vocab_size
        self._tie_across_stages()

    def _tie_across_stages(self) -> None:
        """NOTE [ Tied embeddings across stages ], rules 2-3 (no-op within one chunk)."""
        if self.pre_process == self.post_process:
            return
        weight = self.embedding.weight
        if not self.pre_process:
            weight.shared = True
            weight.shared_embedding = True
            with torch.no_grad():
                weight.zero_()
        else:
            weight.shared_embedding = True
        if parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
            group = parallel_state.get_embedding_group()
            if dist.get_world_size(group) > 1:
                with torch.no_grad():
                    consistency.checked_all_reduce("tied embedding all_reduce", weight.data, group)

    def set_input_tensor(self, input_tensor) -> None:
        """The activation from the previous stage (a tensor, or a list holding one), or None."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise MegatronCoreError(
                    f"GPTModel.set_input_tensor: expected one tensor, got {len(input_tensor)}"
                )
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word embedding (first stage) or its output-layer copy (last stage), else None."""
        if self.pre_process or self.post_process:
            return self.embedding.weight
        return None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        words = self.embedding(input_ids)  # [b, s, h], or [s/tp, b, h] under SP
        cp = self.config.context_parallel_size
        if cp > 1:  # this rank's part of the sequence (NOTE [ Context parallelism ], rule 1)
            rank = parallel_state.get_context_parallel_rank()
            index = cp_positions(s * cp, cp, rank, device=words.device)
            positions = self.position_embeddings.weight.index_select(0, index)
        else:
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
        cp = self.config.context_parallel_size
        if s * cp > self.max_sequence_length:
            raise MegatronCoreError(
                f"GPTModel: sequence length ({s} x context_parallel_size {cp}) exceeds "
                f"max_sequence_length ({self.max_sequence_length})"
            )
        if cp > 1 and s % 2:
            raise MegatronCoreError(
                f"GPTModel: this rank's part of the sequence ({s}) must be even: the sequence is "
                f"cut into 2 * context_parallel_size ({2 * cp}) chunks"
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

    def forward(
        self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the model (this chunk of it under pipeline parallelism).

        Args:
            input_ids: token ids [b, s], the same on every rank of the TP group; ignored (may
                be None) on a chunk without ``pre_process``.
            labels: next-token ids [b, s], or None; used only with ``post_process``.

        Returns:
            With ``post_process``: the fp32 loss of every token [b, s] when ``labels`` is given,
            else this rank's vocab-parallel logits [b, s, V/tp]. Without: the hidden states
            [s, b, h] ([s/tp, b, h] under SP) for the next stage.
        """
        if self.pre_process:
            self._check_input(input_ids, labels)
            hidden = self.decoder(self._embed(input_ids))
        else:
            hidden = self.decoder(None)
        if not self.post_process:
            return hidden
        sequence_parallel = self.config.sequence_parallel
        logits = linear_with_grad_accumulation_and_async_allreduce(
            hidden,
            self.embedding.weight,
            None,
            gradient_accumulation_fusion=False,
            allreduce_dgrad=self.embedding.tp_size > 1 and not sequence_parallel,
            sequence_parallel=sequence_parallel,
            tp_group=self.embedding.tp_group,
        )  # [s, b, V/tp]
        logits = self._mask_padding(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1))
        return loss.transpose(0, 1).contiguous()
