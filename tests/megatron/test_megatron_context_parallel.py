"""megatron-core's own GPTModel (local spec, RoPE, tied embeddings) with context_parallel_size 2
through the switch (NOTE [ Without Transformer Engine ], rule 2), against the same model at
CP=1 on one rank: the same batches, megatron-core's DistributedDataParallel and
finalize_model_grads, three SGD steps; every comm type. Losses (the mean over the CP ranks of
their per-token means: equal token counts, so the global mean) and every parameter must match
to 1e-5. megatron-core's own modules refuse CP without Transformer Engine; here nothing but
``context_parallel_size`` and ``cp_comm_type`` changes."""

import pytest
import torch
import torch.distributed as dist

from megatron_core.testing import run_distributed

SEQ, BATCH, VOCAB, STEPS = 16, 2, 64, 3


RECOMPUTE = {
    None: {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                 distribute_saved_activations=True),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
}  # fmt: skip


def _skip_where_gloo_carries_the_buckets(world_size: int) -> None:
    from _megatron_ddp import skip_where_gloo_carries_the_buckets  # needs megatron-core

    skip_where_gloo_carries_the_buckets(world_size)


def _train(comm: str, tp: int = 1, recompute: str | None = None):
    from megatron_core import megatron as switch

    switch.install()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_core import device
    from megatron_core.context_parallel import get_batch_on_this_cp_rank

    cp = dist.get_world_size() // tp
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=comm,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        **RECOMPUTE[recompute],
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope",
    )  # fmt: skip
    model = model.to(device.current_device())  # a GPU user's model.cuda(); a no-op on CPU
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(
            0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step)
        ).to(device.current_device())
        batch = get_batch_on_this_cp_rank({
            "tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(SEQ, device=tokens.device).expand(BATCH, SEQ),
        })  # fmt: skip
        model.zero_grad_buffer()
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        loss.backward()
        finalize_model_grads([model])
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * param.main_grad)
        total = loss.detach().clone()
        dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
        losses.append(total.item() / cp)
    return losses, {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.requires_megatron_core
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_gpt_model_at_cp2_trains_as_at_cp1(comm):
    _skip_where_gloo_carries_the_buckets(2)
    ((ref_losses, ref_params),) = run_distributed(_train, 1, comm, timeout=300)
    for losses, params in run_distributed(_train, 2, comm, timeout=300):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


def _refused(options: dict):
    from megatron_core import megatron as switch

    switch.install()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=2,
        use_cpu_initialization=True, **options,
    )  # fmt: skip
    try:
        GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return str(error)
    return "no error"


@pytest.mark.requires_megatron_core
@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"attention_dropout": 0.1, "cp_comm_type": "a2a"},
            "attention_dropout (0.1) with context_parallel_size (2) and cp_comm_type 'a2a'",
        ),
        ({"attention_dropout": 0.0, "window_size": (4, 0)}, "window_size ((4, 0))"),
    ],
)
def test_what_cp_does_not_support_is_refused_by_name(options, message):
    for text in run_distributed(_refused, 2, options, timeout=120):
        assert message in text, text


@pytest.mark.requires_megatron_core
def test_gpt_model_at_tp2_cp2_trains_as_at_tp2():
    """TP=2 x CP=2 (4 ranks, TP fastest: ranks 0-1 and 2-3 are TP pairs) against TP=2 (2
    ranks): each TP rank's shards and the losses match."""
    _skip_where_gloo_carries_the_buckets(4)
    reference = run_distributed(_train, 2, "p2p", 2, timeout=300)
    for rank, (losses, params) in enumerate(run_distributed(_train, 4, "p2p", 2, timeout=300)):
        ref_losses, ref_params = reference[rank % 2]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.requires_megatron_core
def test_gpt_model_at_cp2_with_recompute_trains_as_at_cp1():
    """Full recompute (uniform, distributed saved activations: TP=2 x CP=2) and selective
    core_attn recompute (CP=2): the CP attention's collectives run again in the recompute."""
    _skip_where_gloo_carries_the_buckets(4)
    reference = run_distributed(_train, 2, "p2p", 2, timeout=300)
    for rank, (losses, params) in enumerate(run_distributed(_train, 4, "p2p", 2, "full",
                                                            timeout=300)):  # fmt: skip
        ref_losses, ref_params = reference[rank % 2]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)
    ((ref_losses, ref_params),) = run_distributed(_train, 1, "a2a", timeout=300)
    for losses, params in run_distributed(_train, 2, "a2a", 1, "selective", timeout=300):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)
