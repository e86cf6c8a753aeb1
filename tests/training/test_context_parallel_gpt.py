"""The main job with --context-parallel-size (NOTE [ Context parallelism ]): the same losses as
CP=1 for every comm type and composed with data, tensor (with and without sequence) and
pipeline parallelism and with recompute; a checkpoint saved at CP=2 loads at CP=1 and CP=4 and
continues; bad layouts are refused before any process group exists.

All runs train the same tiny GPT on the same fixed corpus for four iterations (dropout 0); the
loss of an iteration is the global batch's per-token mean, so it must equal CP=1's to fp32
rounding (rtol 1e-5): a CP run averages each rank's mean over equal token counts.
"""

import pytest
import torch
from _train_args import argv_of, corpus_file

from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed
from megatron_core.training import parse_args, train
from megatron_core.training.arguments import validate_args

TINY = {
    "data": corpus_file(), "num-layers": 2, "hidden-size": 32, "num-attention-heads": 4,
    "seq-length": 16, "micro-batch-size": 2, "global-batch-size": 4, "lr": 1e-3,
    "min-lr": 1e-4, "lr-warmup-iters": 1, "log-interval": 1000, "train-iters": 4,
    "hidden-dropout": 0.0, "attention-dropout": 0.0, "tensor-model-parallel-size": 1,
}  # fmt: skip


def _losses(argvs):
    return [train(parse_args(argv)).losses for argv in argvs]


def _same(losses, reference):
    assert sorted(losses) == sorted(reference)
    torch.testing.assert_close(
        torch.tensor([losses[k] for k in sorted(losses)]),
        torch.tensor([reference[k] for k in sorted(reference)]),
        rtol=1e-5, atol=0,
    )  # fmt: skip


def test_cp_runs_give_cp1s_losses():
    reference = run_distributed(_losses, 1, [argv_of(TINY)], timeout=300)[0][0]
    two = [argv_of(TINY, context_parallel_size=2, cp_comm_type=comm)
           for comm in ("p2p", "all_gather", "a2a")]  # fmt: skip
    two.append(argv_of(TINY, context_parallel_size=2, recompute_granularity="selective"))
    two.append(argv_of(TINY, context_parallel_size=2, recompute_granularity="full",
                       recompute_method="uniform", recompute_num_layers=1))  # fmt: skip
    four = [
        argv_of(TINY, context_parallel_size=4),
        argv_of(TINY, context_parallel_size=2, tensor_model_parallel_size=2),
        argv_of(TINY, context_parallel_size=2, tensor_model_parallel_size=2,
                sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=1, distribute_saved_activations=False),
        argv_of(TINY, context_parallel_size=2, pipeline_model_parallel_size=2),
        argv_of(TINY, context_parallel_size=2),  # dp=2
    ]  # fmt: skip
    for per_rank in (run_distributed(_losses, 2, two, timeout=300),
                     run_distributed(_losses, 4, four, timeout=300)):  # fmt: skip
        for runs in per_rank:
            for losses in runs:
                _same(losses, reference)


def _save_at_cp2(directory):
    return _losses([argv_of(TINY, context_parallel_size=2, exit_interval=2, save=directory)])


def _load(directory, cp):
    return _losses([argv_of(TINY, context_parallel_size=cp, load=directory)])[0]


def test_a_cp2_checkpoint_loads_at_cp1_and_cp4(tmp_path):
    directory = str(tmp_path / "cp2")
    reference = run_distributed(_losses, 1, [argv_of(TINY)], timeout=300)[0][0]
    run_distributed(_save_at_cp2, 2, directory, timeout=300)
    at_cp1 = run_distributed(_load, 1, directory, 1, timeout=300)[0]
    at_cp4 = run_distributed(_load, 4, directory, 4, timeout=300)[0]
    for resumed in (at_cp1, at_cp4):
        assert sorted(resumed) == [3, 4]
        _same(resumed, {k: reference[k] for k in (3, 4)})


@pytest.mark.parametrize(
    "options, world, message",
    [
        ({"context_parallel_size": 3}, 3, r"--seq-length \(16\) must be divisible by 2 \*"),
        (
            {"context_parallel_size": 2, "attention_dropout": 0.1, "cp_comm_type": "a2a"},
            2,
            r"--attention-dropout \(0.1\) must be 0 with --context-parallel-size \(2\) and "
            r"--cp-comm-type a2a",
        ),
        ({"context_parallel_size": 2}, 3, r"divisible by .* --context-parallel-size \(2\)"),
    ],
)
def test_bad_layouts_are_refused(options, world, message):
    with pytest.raises(MegatronCoreError, match=message):
        validate_args(parse_args(argv_of(TINY, **options)), world)
