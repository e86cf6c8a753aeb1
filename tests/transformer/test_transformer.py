"""megatron_core.transformer: config validation, and the GPT under TP / SP / recompute.

The TP=2 and TP=2+SP models are compared with the TP=1 model built from the same seed (the
weights are drawn full on the CPU, so they are the same model). Tolerance: torch.testing's fp32
defaults; the layouts compute the same sums, only split into per-rank partial sums and reduced.
"""

import math

import pytest
import torch

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import (
    allreduce_sequence_parallel_grads,
    broadcast_data,
    gather_from_tensor_model_parallel_region,
    model_parallel_cuda_manual_seed,
)
from megatron_core.tensor_parallel.random import keep_device_stream_apart
from megatron_core.tensor_parallel.recompute.memory import count_saved_activations
from megatron_core.testing import run_distributed
from megatron_core.testing.worker import harness_device_type
from megatron_core.transformer import GPTModel, TransformerConfig, scaled_init_method_normal

SHAPE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
VOCAB, SEQ, BATCH = 256, 16, 2


# --- config (no processes) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_layers": 0}, r"num_layers \(0\) must be >= 1"),
        ({"hidden_size": 30}, r"num_attention_heads \(4\) must divide hidden_size \(30\)"),
        (
            {"num_attention_heads": 4, "tensor_model_parallel_size": 8, "hidden_size": 32},
            r"num_attention_heads \(4\) must be divisible by tensor_model_parallel_size \(8\)",
        ),
        ({"hidden_dropout": 1.0}, r"hidden_dropout \(1.0\) must be in \[0, 1\)"),
        ({"recompute_granularity": "some"}, r"recompute_granularity \('some'\) must be one of"),
        ({"recompute_method": "uniform"}, r"recompute_method \('uniform'\) needs .*'full'"),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            r"recompute_num_layers \(1\) needs recompute_granularity='full' \(got 'selective'\)",
        ),
        ({"recompute_granularity": "full"}, r"needs recompute_method"),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 3,
            },
            r"recompute_num_layers \(3\) must be an integer in \[1, num_layers \(2\)\]",
        ),
        ({"distribute_saved_activations": True}, r"distribute_saved_activations \(True\) needs"),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 1,
                "distribute_saved_activations": True,
                "tensor_model_parallel_size": 2,
                "sequence_parallel": True,
            },
            r"cannot be used with sequence_parallel",
        ),
    ],
)
def test_config_rejects(options, message):
    with pytest.raises(MegatronCoreError, match=message):
        TransformerConfig(**{**SHAPE, **options})


def test_config_defaults_follow_megatron():
    config = TransformerConfig(**SHAPE)
    assert config.ffn_hidden_size == 128 and config.kv_channels == 8
    assert config.hidden_dropout == config.attention_dropout == 0.1
    weight = torch.empty(20_000)
    torch.manual_seed(0)
    scaled_init_method_normal(0.02, 8)(weight)
    assert weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


# --- the model on 1 and 2 ranks ---------------------------------------------------------------


def _config(tp, sp=False, dropout=0.0, **options):
    return TransformerConfig(
        **SHAPE,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        **options,
    )


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=gen
    )


def _forward_backward(tp, sp):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(11)
    model = GPTModel(_config(tp, sp), VOCAB, SEQ)
    tokens, labels = _batch()
    loss = model(tokens, labels)
    loss.mean().backward()
    allreduce_sequence_parallel_grads(model)
    logits = gather_from_tensor_model_parallel_region(model(tokens))
    group = parallel_state.get_tensor_model_parallel_group()
    full_embedding_grad = [torch.empty_like(model.embedding.weight.grad) for _ in range(tp)]
    torch.distributed.all_gather(full_embedding_grad, model.embedding.weight.grad, group=group)
    marked = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", 0))
    return {
        "loss": loss.detach(),
        "logits": logits.detach(),
        "embedding grad": torch.cat(full_embedding_grad),
        "position grad": model.position_embeddings.weight.grad,
        "final norm grad": model.decoder.final_layernorm.weight.grad,
        "marked": marked,
    }


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_tp2_model_matches_tp1(sequence_parallel):
    (reference,) = run_distributed(_forward_backward, 1, 1, False)
    for result in run_distributed(_forward_backward, 2, 2, sequence_parallel):
        for key in ("loss", "logits", "embedding grad", "position grad", "final norm grad"):
            torch.testing.assert_close(result[key], reference[key], msg=key)
        if sequence_parallel:  # every replicated parameter with a partial gradient is marked
            assert "position_embeddings.weight" in result["marked"]
            assert "decoder.final_layernorm.bias" in result["marked"]
            assert "decoder.layers.1.mlp.dense_4h_to_h.bias" in result["marked"]
            assert len(result["marked"]) == 1 + 2 + 2 * (4 + 2)
        else:
            assert result["marked"] == []


def _replicas_after_rank0_data_path(apart):
    """10 SGD steps of the TP=2 GPT with dropout on, its batches loaded on TP rank 0 only (a
    shuffling DataLoader, whose iterator draws a seed from the CPU generator) and broadcast;
    whether each replicated parameter is bitwise the same on both ranks afterwards. ``apart``
    False: the CPU generator serves dropout too (NOTE [ RNG streams ], rule 6)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(11)
    if not apart:
        keep_device_stream_apart(False)
    model = GPTModel(_config(2, dropout=0.1), VOCAB, SEQ).to(device.current_device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens, labels = _batch()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for _ in range(10):
        data = None
        if rank == 0:
            loader = torch.utils.data.DataLoader(
                list(zip(tokens, labels)), batch_size=BATCH, shuffle=True
            )
            batch = next(iter(loader))
            data = {"tokens": batch[0], "labels": batch[1]}
        data = broadcast_data(["tokens", "labels"], data, torch.int64)
        optimizer.zero_grad()
        model(data["tokens"], data["labels"]).mean().backward()
        optimizer.step()
    group = parallel_state.get_tensor_model_parallel_group()
    same = {}
    for name, param in model.named_parameters():
        if not getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(param) for _ in range(2)]
            torch.distributed.all_gather(parts, param.detach(), group=group)
            same[name] = torch.equal(parts[0], parts[1])
    return same


def test_rank0_data_path_leaves_the_replicas_equal():
    # Replicated parameters (layer norms, position embeddings, row-parallel biases) stay
    # bitwise equal across TP ranks over 10 steps with dropout on, although only TP rank 0
    # draws on the host; on a CPU, with the CPU generator serving dropout too, they drift (on a
    # GPU dropout draws from CUDA's generator, which host draws never touch: no drift either way).
    for same in run_distributed(_replicas_after_rank0_data_path, 2, True):
        assert len(same) >= 10 and all(same.values()), [n for n, ok in same.items() if not ok]
    control = run_distributed(_replicas_after_rank0_data_path, 2, False)[0].values()
    assert all(control) if harness_device_type() == "cuda" else not all(control)


def _causal_and_errors():
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(3)
    model = GPTModel(_config(1, dropout=0.3), VOCAB, SEQ).eval()
    tokens, _ = _batch()
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB
    before, after = model(tokens), model(changed)
    errors = {}
    for name, call in {
        "too long": lambda: model(torch.zeros(1, SEQ + 1, dtype=torch.long)),
        "labels": lambda: model(tokens, tokens[:, :4]),
        "rank 1": lambda: model(tokens[0]),
    }.items():
        try:
            call()
        except MegatronCoreError as exc:
            errors[name] = str(exc)
    same_prefix = torch.equal(before[:, :9], after[:, :9])
    return (
        same_prefix,
        torch.equal(before[:, 9:], after[:, 9:]),
        torch.equal(before, model(tokens)),
        errors,
    )


def test_causal_deterministic_in_eval_and_clear_input_errors():
    same_prefix, same_suffix, repeatable, errors = run_distributed(_causal_and_errors, 1)[0]
    assert same_prefix and not same_suffix  # position 9 influences only positions >= 9
    assert repeatable  # eval(): no dropout
    assert "exceeds max_sequence_length (16)" in errors["too long"]
    assert "labels shape (2, 4) must equal input_ids shape (2, 16)" in errors["labels"]
    assert "must be [batch, sequence]" in errors["rank 1"]


# --- activation memory under recompute --------------------------------------------------------


RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full distributed": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "distribute_saved_activations": True,
    },
}


def _saved_bytes():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    saved = {}
    for name, options in RECOMPUTE.items():
        model_parallel_cuda_manual_seed(3)
        model = GPTModel(_config(2, dropout=0.1, **options), VOCAB, SEQ)
        tokens, labels = _batch()
        with count_saved_activations(ignore=model.parameters()) as report:
            loss = model(tokens, labels).mean()
        loss.backward()
        saved[name] = report.total_bytes
    return saved


def test_recompute_saves_less():
    for saved in run_distributed(_saved_bytes, 2):
        assert saved["none"] > saved["selective"] > saved["full"] > saved["full distributed"], saved
