"""Train megatron-core's own GPTModel at TP=2 on two CPU processes (the README's example).

    torchrun --nproc-per-node 2 scripts/megatron_gpt_example.py

megatron-core's code as written for a GPU, unpatched: the causal mask it makes on "cuda", its
DistributedDataParallel and the optimizer get_megatron_optimizer builds. Without CUDA the
switch's CPU mode runs them on the CPU (and the "nccl" process group is gloo).
"""

import megatron_core.megatron

megatron_core.megatron.install()  # before anything imports megatron

import torch  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402  (this package's)
from megatron.core.distributed import (  # noqa: E402  (megatron-core's own)
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

torch.distributed.init_process_group("nccl")
torch.cuda.set_device(torch.distributed.get_rank() % max(torch.cuda.device_count(), 1))
parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
tensor_parallel.model_parallel_cuda_manual_seed(1234)
config = TransformerConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
    hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
model = DistributedDataParallel(config, DistributedDataParallelConfig(), model.cuda())
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3), [model])
tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0)).cuda()
positions = torch.arange(32, device="cuda").expand(4, 32)
for step in range(20):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    finalize_model_grads([model])
    optimizer.step()
    if torch.distributed.get_rank() == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)
parallel_state.destroy_model_parallel()
torch.distributed.barrier()  # every rank done with its last collective before any tears down
torch.distributed.destroy_process_group()
