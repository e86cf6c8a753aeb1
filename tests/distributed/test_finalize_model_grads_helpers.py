"""megatron-core's private finalize_model_grads helpers, by name (NOTE [ Gradient finalization ],
rule 8): the word embedding, the TP-replicated parameters and the replicated conditional
embedders, on 4 gloo ranks (tp=2 x pp=2), against sums computed by hand and, where megatron-core
is installed, against megatron-core's own helpers given the same groups."""

import importlib
import types

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed

fmg = importlib.import_module("megatron_core.distributed.finalize_model_grads")
HAVE_MEGATRON = megatron_core_version() is not None


class _Chunk(torch.nn.Module):
    """What the helpers read of a GPT chunk: an embedding that may be tied to the output layer,
    a sequence-parallel norm, a q_layernorm, a TP-averaged weight, an ordinary weight and a
    replicated embedder marked ``pipeline_parallel``."""

    def __init__(self, tied: bool):
        super().__init__()
        self.pre_process = True
        self.share_embeddings_and_output_weights = tied
        self.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)  # megatron-core reads it
        self.embedding = torch.nn.Parameter(torch.zeros(3, 2))
        self.norm = torch.nn.Parameter(torch.zeros(2))
        self.norm.sequence_parallel = True
        self.q_layernorm = torch.nn.Parameter(torch.zeros(2))
        self.router = torch.nn.Parameter(torch.zeros(2))
        self.router.average_gradients_across_tp_domain = True
        self.plain = torch.nn.Parameter(torch.zeros(2))
        self.embedder = torch.nn.Parameter(torch.zeros(2))
        self.embedder.pipeline_parallel = True

    def shared_embedding_or_output_weight(self):
        return self.embedding


def _model(rank: int, chunks: int, tied: bool = True) -> list:
    """``chunks`` chunks whose gradients are rank * 100 + chunk * 10 + parameter index (exact
    in float32, so sums are bitwise comparable)."""
    model = [_Chunk(tied) for _ in range(chunks)]
    for c, chunk in enumerate(model):
        for i, param in enumerate(chunk.parameters()):
            param.grad = torch.full_like(param, rank * 100.0 + c * 10.0 + i)
    return model


def _grads(model) -> dict:
    return {
        f"{c}.{name}": param.grad.tolist()
        for c, chunk in enumerate(model)
        for name, param in chunk.named_parameters()
    }


class _QuantileRouter(torch.nn.Module):
    """What 0.19's quantile balancing keeps on a router: ``qb_beta`` and the per-step sums."""

    def __init__(self, rank: int):
        super().__init__()
        self.config = types.SimpleNamespace(
            moe_router_load_balancing_type="quantile_balancing",
            moe_router_quantile_balancing_ema=0.75,
        )
        self.register_buffer("qb_beta", torch.tensor([1.0, -1.0, 2.0, -2.0]))
        self.register_buffer("qb_beta_accum", torch.arange(4.0) * (rank + 1))
        self.register_buffer("qb_beta_count", torch.tensor(rank + 2))
        self.weight = torch.nn.Parameter(torch.zeros(2))


def _quantile_reference(ranks: list[int]) -> list[float]:
    """qb_beta after one step, the mean over ``ranks`` of accum / count computed by hand."""
    mean = sum(torch.arange(4.0) * (r + 1) / (r + 2) for r in ranks) / len(ranks)
    blended = 0.75 * torch.tensor([1.0, -1.0, 2.0, -2.0]) + 0.25 * mean
    return (blended - blended.mean()).tolist()


def _body(use_megatron: bool) -> dict:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    rank = dist.get_rank()
    tp = parallel_state.get_tensor_model_parallel_group()
    pp = parallel_state.get_pipeline_model_parallel_group()
    embd = parallel_state.get_embedding_group()
    config = types.SimpleNamespace(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=1)
    out = {}
    implementations = {"ours": fmg}
    if use_megatron:
        from _megatron_ddp import megatron_cores_finalize_module

        implementations["megatron"] = megatron_cores_finalize_module()
    for label, module in implementations.items():
        model = _model(rank, 1)
        module._allreduce_word_embedding_grads(model, config, embd, pp)
        out[f"{label} word"] = _grads(model)
        model = _model(rank, 1, tied=False)
        module._allreduce_word_embedding_grads(model, config, embd, pp)
        out[f"{label} untied"] = _grads(model)
        model = _model(rank, 1)
        for param in model[0].parameters():  # megatron-core's AVG all-reduce is NCCL-only
            param.average_gradients_across_tp_domain = False
        module._allreduce_non_tensor_model_parallel_grads(model, config, tp)
        out[f"{label} tp sums"] = _grads(model)
        model = [_Chunk(True), _Chunk(True)]  # two virtual stages
        for c, chunk in enumerate(model):
            for param in chunk.parameters():
                param.main_grad = torch.full_like(param, rank * 100.0 + c * 10.0)
        module._allreduce_conditional_embedding_grads(model, config, pp)
        out[f"{label} cond"] = [
            [p.main_grad.tolist() for p in (chunk.embedder, chunk.plain)] for chunk in model
        ]
    model = _model(rank, 1)
    fmg._allreduce_non_tensor_model_parallel_grads(model, config)  # tp group from parallel_state
    out["ours tp"] = _grads(model)
    model = _model(rank, 1)
    fmg._allreduce_word_embedding_grads(model, config)  # both groups from parallel_state
    out["ours word default groups"] = _grads(model)
    router = _QuantileRouter(rank)
    fmg._update_router_qb_beta([router], router.config, pp)  # a two-rank group given
    out["qb over pp"] = router.qb_beta.tolist()
    router = _QuantileRouter(rank)
    router.weight.grad = torch.zeros(2)
    fmg.finalize_model_grads([router])  # dp x cp group of one rank: this rank's own quantiles
    out["qb finalize"] = router.qb_beta.tolist()
    out["qb cleared"] = (router.qb_beta_accum.tolist(), int(router.qb_beta_count))
    router = _QuantileRouter(rank).eval()  # an evaluating router is left alone
    fmg._update_router_qb_beta([router], router.config)
    out["qb eval"] = router.qb_beta.tolist()
    return out


@pytest.mark.parametrize("use_megatron", [False, True] if HAVE_MEGATRON else [False])
def test_helpers_reduce_over_the_right_groups(use_megatron):
    results = run_distributed(_body, 4, use_megatron, timeout=240)
    # Rank layout (tp-pp): tp groups {0,1} {2,3}; pp and embedding groups {0,2} {1,3}.
    for rank, out in enumerate(results):
        tp_peer, pp_peer = rank ^ 1, rank ^ 2
        own = _grads(_model(rank, 1))
        # word embedding (parameter 0): summed with the other stage's copy; the rest kept
        word = dict(own)
        word["0.embedding"] = [[100.0 * (rank + pp_peer)] * 2] * 3
        assert out["ours word"] == word == out["ours word default groups"]
        assert out["ours untied"] == own
        # TP: the sequence-parallel norm (1) and q_layernorm (2) summed over the TP pair; the
        # averaged router (3) averaged; the rest kept.
        peer = _grads(_model(tp_peer, 1))
        tp = dict(own)
        for key in ("0.norm", "0.q_layernorm"):
            tp[key] = [a + b for a, b in zip(own[key], peer[key])]
        tp["0.router"] = [(a + b) / 2 for a, b in zip(own["0.router"], peer["0.router"])]
        assert out["ours tp"] == tp
        sums = dict(tp, **{"0.router": own["0.router"]})
        assert out["ours tp sums"] == sums
        # conditional embedders: both chunks of both stages added, written to every copy
        total = sum(100.0 * r + 10.0 * c for r in (rank, pp_peer) for c in (0, 1))
        for c, (embedder, plain) in enumerate(out["ours cond"]):
            assert embedder == [total, total]
            assert plain == [100.0 * rank + 10.0 * c] * 2
        # 0.19's quantile balancing (rule 7): averaged over the group given, else dp x cp
        assert out["qb over pp"] == pytest.approx(_quantile_reference([rank, pp_peer]), abs=1e-6)
        assert out["qb finalize"] == pytest.approx(_quantile_reference([rank]), abs=1e-6)
        assert out["qb cleared"] == ([0.0] * 4, 0)
        assert out["qb eval"] == [1.0, -1.0, 2.0, -2.0]
        if use_megatron:
            for key in ("word", "untied", "tp sums", "cond"):
                assert out[f"ours {key}"] == out[f"megatron {key}"], (rank, key)


def test_helpers_have_megatron_cores_names_and_parameters():
    import inspect

    expected = {
        "_allreduce_word_embedding_grads": ["model", "config", "embd_group", "pp_group"],
        "_allreduce_non_tensor_model_parallel_grads": ["model", "config", "tp_group"],
        "_allreduce_conditional_embedding_grads": ["model", "config", "pp_group"],
        "_update_router_qb_beta": ["model", "config", "dp_cp_group"],
    }
    for name, parameters in expected.items():
        signature = inspect.signature(getattr(fmg, name))
        assert list(signature.parameters) == parameters, name
        groups = parameters[2:]  # they default to parallel_state's
        assert all(signature.parameters[p].default is None for p in groups), name
    assert fmg._allreduce_layernorm_grads is fmg._allreduce_non_tensor_model_parallel_grads


def test_word_embedding_refuses_a_pp_group_without_an_embedding_group():
    results = run_distributed(_refusal_body, 4, timeout=240)
    assert all("pp_group was given without embd_group" in message for message in results)


def _refusal_body() -> str:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    try:
        fmg._allreduce_word_embedding_grads(_model(dist.get_rank(), 1), None, None, pp_group)
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return str(error)
    return "no error"
