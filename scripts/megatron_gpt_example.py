"""Train megatron-core's own GPTModel at TP=2 on two CPU processes (the README's example).

    torchrun --nproc-per-node 2 scripts/megatron_gpt_example.py
"""

import megatron_core.megatron

megatron_core.megatron.install()  # before anything imports megatron

import torch  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402  (this package's)
from megatron.core.models.gpt import GPTModel  # noqa: E402  (megatron-core's own)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

torch.distributed.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
tensor_parallel.model_parallel_cuda_manual_seed(1234)
config = TransformerConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
    use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
positions = torch.arange(32).expand(4, 32)
causal = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool), 1)  # megatron-core makes it on cuda
for step in range(20):
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).mean()
    loss.backward()
    optimizer.step()
    if torch.distributed.get_rank() == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.3f}")
parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
