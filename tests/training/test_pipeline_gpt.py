"""The main job at pp > 1: the GPT split over stages trains like the unsplit GPT.

Each run is ``train(args)`` on gloo ranks. A pp run starts from the same weights as pp = 1
(NOTE [ Same model at every pp ] in training/pipeline_step.py) and, with dropout off, does the
same arithmetic except for the order of a few sums (the tied embedding's gradient is the sum of
the first stage's and the last stage's parts instead of being accumulated in one graph; DP
averages). Rounding differences of ~1e-7 relative grow slowly through 20 AdamW steps: the 1e-5
relative tolerance is the issue's bar and sits well above the ~1e-6 observed.
"""

import pytest
import torch
from _train_args import argv_of, corpus_file

from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed
from megatron_core.training import parse_args, train, validate_args
from megatron_core.training.pipeline_step import model_chunks

TINY = {
    "data": corpus_file(),  # fixed: runs compared with each other see the same batches
    "num-layers": 4,
    "hidden-size": 32,
    "num-attention-heads": 4,
    "seq-length": 16,
    "micro-batch-size": 2,
    "global-batch-size": 8,
    "lr": 1e-3,
    "min-lr": 1e-4,
    "lr-warmup-iters": 2,
    "log-interval": 1000,
    "train-iters": 20,
    "hidden-dropout": 0.0,
    "attention-dropout": 0.0,
    "tensor-model-parallel-size": 1,
}


def _argv(**options) -> list[str]:
    """argv for parse_args: TINY updated by ``options`` (True: a bare flag, None: left out)."""
    return argv_of(TINY, **options)


def _runs(argvs: list[list[str]]):
    """Per-rank body: train each argv in turn; return (losses, global state) per run."""
    results = []
    for argv in argvs:
        result = train(parse_args(argv))
        results.append((result.losses, _state_of(result.model), result.num_parameters))
    return results


def _state_of(model) -> dict:
    """Global parameter name -> tensor for this rank's chunks: layers renumbered by
    layer_offset (stage 1's layer 0 of a 4-layer pp=2 model is decoder.layers.2)."""
    state = {}
    for chunk in model_chunks(model):
        for key, value in chunk.state_dict().items():
            if not isinstance(value, torch.Tensor):
                continue  # _extra_state entries
            if key.startswith("decoder.layers."):
                index, rest = key[len("decoder.layers.") :].split(".", 1)
                key = f"decoder.layers.{int(index) + chunk.layer_offset}.{rest}"
            state[key] = value.detach().clone()
    return state


def _merge(per_rank_states: list[dict]) -> dict:
    """Union over ranks; a key held by several ranks (DP replicas, tied copies) must agree."""
    merged = {}
    for state in per_rank_states:
        for key, value in state.items():
            if key in merged:
                assert torch.equal(merged[key], value), key
            merged[key] = value
    return merged


def _assert_same_training(run, reference, tp_size: int = 1, iterations: int = 20):
    losses, states = run
    ref_losses, ref_states = reference
    assert sorted(losses) == sorted(ref_losses) == list(range(1, iterations + 1))
    torch.testing.assert_close(
        torch.tensor([losses[k] for k in sorted(losses)]),
        torch.tensor([ref_losses[k] for k in sorted(ref_losses)]),
        rtol=1e-5,
        atol=0,
    )
    assert states.keys() == ref_states.keys()
    # Relative to the whole parameter vector's norm. Per tensor it would not hold: the key
    # bias's gradient is 0 in exact arithmetic (softmax ignores a shift), so its fp32 value is
    # rounding noise that Adam normalizes to full-size steps, different for every sum order.
    keys = sorted(ref_states)
    got = torch.cat([states[k].reshape(-1) for k in keys])
    want = torch.cat([ref_states[k].reshape(-1) for k in keys])
    error = ((got - want).norm() / want.norm()).item()
    assert error <= 1e-5, error


def _collect(per_rank, index, tp_size):
    """Run ``index``'s losses (equal on every rank) and merged state (TP rank = rank % tp)."""
    states = []
    for rank, runs in enumerate(per_rank):
        losses, state, _ = runs[index]
        assert losses == per_rank[0][index][0], rank
        states.append({(rank % tp_size, key): v for key, v in state.items()})  # tp is fastest
    return per_rank[0][index][0], _merge(states)


PP2 = {"pipeline_model_parallel_size": 2}
VP2 = {"num_layers_per_virtual_pipeline_stage": 1}
SP2 = {"tensor_model_parallel_size": 2, "sequence_parallel": True}


def test_pipeline_runs_match_pp1():
    """pp=2, pp=2 interleaved (vp=2), pp=2 x dp=2 vs pp=1; tp=2 x pp=2 with SP vs tp=2 + SP.

    --clip-grad 0.05 keeps clipping active every step, so the global norm must count the tied
    embedding once (its last-stage copy is skipped): counting it twice was seen to move the
    losses by 2.5e-5 relative within 5 steps; 8 steps show it (20 took 2.5x the time)."""
    clip = {"clip_grad": 0.05, "train_iters": 8}
    reference = _collect(run_distributed(_runs, 1, [_argv(**clip)], timeout=300), 0, 1)
    two = run_distributed(
        _runs,
        2,
        [
            _argv(**PP2, **clip),
            _argv(**PP2, **VP2, **clip),
            _argv(**SP2, **clip),
        ],
        timeout=300,
    )
    four = run_distributed(
        _runs, 4, [_argv(**PP2, **clip), _argv(**PP2, **SP2, **clip)], timeout=300
    )
    steps = clip["train_iters"]
    _assert_same_training(_collect(two, 0, 1), reference, iterations=steps)
    _assert_same_training(_collect(two, 1, 1), reference, iterations=steps)
    _assert_same_training(_collect(four, 0, 1), reference, iterations=steps)
    _assert_same_training(_collect(four, 1, 2), _collect(two, 2, 2), iterations=steps)


def _recompute_pair():
    common = {
        **PP2,
        "tensor_model_parallel_size": 2,
        "hidden_dropout": 0.1,
        "attention_dropout": 0.1,
        "train_iters": 5,
    }
    full = {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "distribute_saved_activations": True,
    }
    return _runs([_argv(**common), _argv(**common, **full)])


def test_full_recompute_with_dropout_is_bitwise_equal_at_pp2():
    """tp=2 x pp=2, dropout 0.1: full (reentrant) recompute with distributed saved activations
    replays every mask, so losses and parameters are bitwise those without recompute."""
    for plain, recomputed in run_distributed(_recompute_pair, 4, timeout=300):
        assert plain[0] == recomputed[0]
        for key, value in plain[1].items():
            assert torch.equal(recomputed[1][key], value), key


def _resume(directory: str):
    common = {**PP2, "hidden_dropout": 0.1, "attention_dropout": 0.1, "train_iters": 6}
    return _runs(
        [
            _argv(**common),
            _argv(**common, exit_interval=3, save=directory),
            _argv(**common, load=directory),
        ]
    )


def test_resume_at_pp2_is_bitwise(tmp_path):
    for straight, first, resumed in run_distributed(_resume, 2, str(tmp_path), timeout=300):
        assert sorted(first[0]) == [1, 2, 3] and sorted(resumed[0]) == [4, 5, 6]
        assert {**first[0], **resumed[0]} == straight[0]
        for key, value in straight[1].items():
            assert torch.equal(resumed[1][key], value), key


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_layers_per_virtual_pipeline_stage": 1}, r"needs --pipeline-model-parallel-size"),
        ({**PP2, "num_layers": 3}, r"--num-layers \(3\) must be divisible by"),
        (
            {**PP2, "num_layers_per_virtual_pipeline_stage": 3},
            r"must be divisible by --num-layers-per-virtual-pipeline-stage \(3\)",
        ),
    ],
)
def test_pipeline_flags_rejected_without_processes(options, message):
    with pytest.raises(MegatronCoreError, match=message):
        parse_args(_argv(**options))


def test_interleaving_needs_microbatches_divisible_by_pp():
    args = parse_args(_argv(**PP2, num_layers_per_virtual_pipeline_stage=1, global_batch_size=6))
    with pytest.raises(MegatronCoreError, match=r"microbatches per step \(3 ="):
        validate_args(args, 2)


def _shared_copy():
    result = train(parse_args(_argv(**PP2, train_iters=1)))
    weight = model_chunks(result.model)[0].shared_embedding_or_output_weight()
    chunk = model_chunks(result.model)[0]
    return chunk.pre_process, getattr(weight, "shared", False), result.num_parameters


def test_tied_embedding_copy_is_marked_shared_and_counted_once():
    ((_, _, whole),) = run_distributed(_runs, 1, [_argv(train_iters=1)], timeout=300)[0]
    (first_pre, first_shared, first), (last_pre, last_shared, last) = [
        (pre, shared, count) for pre, shared, count in run_distributed(_shared_copy, 2, timeout=300)
    ]
    assert first_pre and not first_shared
    assert not last_pre and last_shared
    assert first == last == whole


def _activation_bytes():
    """(peak saved bytes of one microbatch without, with distributed saved activations)."""
    results = []
    for distribute in (False, True):
        full = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
            "distribute_saved_activations": distribute,
        }
        args = parse_args(_argv(**PP2, tensor_model_parallel_size=2, train_iters=1, **full))
        results.append(train(args).activation_bytes)
    return results


def test_distributed_saved_activations_keep_one_tp_share_of_checkpoint_inputs():
    """tp=2 x pp=2, full recompute, one layer per checkpoint: each stage keeps its 2 layers'
    inputs [s, b, h] fp32; distributed, each rank keeps 1/tp of them, and nothing else changes."""
    s, b, h, layers_per_stage, tp = 16, 2, 32, 2, 2
    inputs = layers_per_stage * s * b * h * 4
    for rank, (full, distributed) in enumerate(run_distributed(_activation_bytes, 4, timeout=300)):
        assert full - distributed == inputs - inputs // tp, rank


def test_bf16_and_fp16_at_pp2_match_pp1():
    """--bf16 / --fp16 (half weights and activations, fp32 main grads and weights; fp16 with
    dynamic loss scaling through config.grad_scale_func) through the pipeline: half-precision
    activations cross the stages (pipeline_dtype) and the mixed-precision optimizer steps as at
    pp=1. 8 steps; tolerance 1e-4 relative: the runs differ only where fp32 sums run in another
    order (tied embedding), which moves a few half-precision weights by one ulp; the observed
    loss differences are ~1e-5."""
    runs = {"bf16": {"bf16": True, "train_iters": 8}, "fp16": {"fp16": True, "train_iters": 8}}
    reference = run_distributed(_runs, 1, [_argv(**o) for o in runs.values()], timeout=300)[0]
    piped = run_distributed(
        _runs,
        2,
        [
            _argv(**PP2, **runs["bf16"]),
            _argv(**PP2, num_layers_per_virtual_pipeline_stage=1, **runs["bf16"]),
            _argv(**PP2, **runs["fp16"]),
        ],
        timeout=300,
    )[0]
    for (losses, _, _), ref in zip(piped, [reference[0], reference[0], reference[1]]):
        want = torch.tensor([ref[0][k] for k in range(1, 9)])
        got = torch.tensor([losses[k] for k in range(1, 9)])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_layers": 3, "pipeline_model_parallel_size": 2}, r"num_layers \(3\) must be"),
        (
            {"num_layers": 4, "pipeline_model_parallel_size": 2,
             "virtual_pipeline_model_parallel_size": 4},
            r"num_layers \(4\) must be divisible by pipeline_model_parallel_size \(2\) \* "
            r"virtual_pipeline_model_parallel_size \(4\)",
        ),
        ({"num_layers": 4, "virtual_pipeline_model_parallel_size": 2}, r"needs pipeline_model"),
    ],
)  # fmt: skip
def test_transformer_config_rejects_uneven_stages(options, message):
    from megatron_core.transformer import TransformerConfig

    with pytest.raises(MegatronCoreError, match=message):
        TransformerConfig(
            hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32, **options
        )


def _resume_at_pp1(directory: str):
    common = {"train_iters": 6}  # dropout off: the stages' dropout streams differ from pp=1's
    return _runs(
        [
            _argv(**common),  # pp=1 x dp=2, straight
            _argv(**PP2, **common, exit_interval=3, save=directory),
            _argv(**common, load=directory),  # pp=1 x dp=2 from the pp=2 checkpoint
            _argv(**PP2, **VP2, **common, exit_interval=3, save=directory + "/vp"),
            _argv(**common, load=directory + "/vp"),  # ... from the interleaved checkpoint
        ]
    )


def test_pp2_checkpoint_resumes_at_pp1(tmp_path):
    """Saved at pp=2 and at pp=2 interleaved (layers keyed by global index, the tied copy saved
    once), resumed at pp=1: the run continues as a pp=1 run from the start would (1e-5, as in
    the pp=1 comparison)."""
    for straight, *pairs in run_distributed(_resume_at_pp1, 2, str(tmp_path), timeout=300):
        for first, resumed in (pairs[:2], pairs[2:]):
            _assert_continues(straight, first, resumed)


def _assert_continues(straight, first, resumed):
    assert sorted(first[0]) == [1, 2, 3] and sorted(resumed[0]) == [4, 5, 6]
    losses = {**first[0], **resumed[0]}
    got = torch.tensor([losses[k] for k in range(1, 7)])
    want = torch.tensor([straight[0][k] for k in range(1, 7)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    keys = sorted(straight[1])
    assert sorted(resumed[1]) == keys
    got = torch.cat([resumed[1][k].reshape(-1) for k in keys])
    want = torch.cat([straight[1][k].reshape(-1) for k in keys])
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def _iterations_marked(argvs: list[list[str]]) -> list[tuple[int, int]]:
    from megatron_core import consistency

    deltas = []
    for argv in argvs:
        before = consistency.iterations_seen()
        train(parse_args(argv))
        after = consistency.iterations_seen()
        deltas.append((after[0] - before[0], after[1] - before[1]))
    return deltas


def test_each_training_step_is_one_iteration_of_the_check_window():
    """NOTE [ Check window ], rule 1: the main job's step (its schedule and its gradient
    finalization nested inside) counts once, at pp=1 (finalize only) and at pp=2."""
    argvs = [_argv(train_iters=3, **SP2), _argv(train_iters=3, **PP2)]
    assert run_distributed(_iterations_marked, 2, argvs, timeout=300) == [[(3, 3), (3, 3)]] * 2
