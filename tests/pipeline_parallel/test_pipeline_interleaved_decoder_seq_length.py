"""The interleaved schedule sizes its exchanges by ``seq_length`` and ignores
``decoder_seq_length``, as megatron-core's does (0.16.1 and 0.19); the 1F1B schedule without
interleaving uses ``decoder_seq_length`` when given (``get_tensor_shapes``)."""

import torch
import torch.distributed as dist

from megatron_core import ModelParallelConfig, parallel_state
from megatron_core.pipeline_parallel import schedules
from megatron_core.testing import run_distributed

SEQ, MICRO_BATCH, HIDDEN = 6, 2, 4


class _Chunk(torch.nn.Module):
    """A model chunk as the schedules see it: ``set_input_tensor`` keeps the received tensor."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.received = None

    def set_input_tensor(self, tensor):
        self.received = tensor[0] if isinstance(tensor, list) else tensor


def _body(decoder_seq_length):
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    config.hidden_size = HIDDEN
    chunks = [_Chunk(config), _Chunk(config)]
    shapes = []

    def forward_step(data_iterator, model):
        if model.received is not None:
            shapes.append(tuple(model.received.shape))
        output = torch.full((SEQ, MICRO_BATCH, HIDDEN), float(dist.get_rank()))
        return output, lambda out: (out.sum(), {"loss": out.sum()})

    losses = schedules.forward_backward_pipelining_with_interleaving(
        forward_step_func=forward_step,
        data_iterator=[iter(range(8)), iter(range(8))],
        model=chunks,
        num_microbatches=4,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        decoder_seq_length=decoder_seq_length,
        forward_only=True,
    )
    return sorted(set(shapes)), len(losses)


def test_interleaved_exchanges_are_seq_length_long_whatever_the_decoder_length():
    for decoder_seq_length in (None, SEQ // 2):
        results = run_distributed(_body, 2, decoder_seq_length, timeout=240)
        for rank, (shapes, losses) in enumerate(results):
            assert shapes == [(SEQ, MICRO_BATCH, HIDDEN)], (rank, decoder_seq_length)
            assert losses == (4 if rank == 1 else 0)  # the last stage's loss dicts


def test_non_interleaved_shapes_use_the_decoder_length():
    config = ModelParallelConfig(pipeline_dtype=torch.float32)
    config.hidden_size = HIDDEN
    one = run_distributed(_shapes_body, 1, config)[0]
    assert one == [(SEQ // 2, MICRO_BATCH, HIDDEN)]


def _shapes_body(config):
    parallel_state.initialize_model_parallel()
    return schedules.get_tensor_shapes(
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        decoder_seq_length=SEQ // 2,
        config=config,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group(),
    )
