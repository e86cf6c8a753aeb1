"""End to end: megatron_core.training.train (the engine of scripts/train_gpt.py) and the script.

Every multi-rank check calls ``train(args)`` inside ``run_distributed``; one test runs the real
torchrun command. Models are tiny (1-2 layers, hidden 32, sequence 16) to keep the file fast.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_args import argv_of, corpus_file

from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed
from megatron_core.training import (
    TRACKER_FILENAME,
    ByteCorpus,
    learning_rate,
    model_config,
    parse_args,
    train,
    validate_args,
)

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "data": corpus_file(),  # fixed: runs compared with each other see the same batches
    "num-layers": 2,
    "hidden-size": 32,
    "num-attention-heads": 4,
    "seq-length": 16,
    "micro-batch-size": 2,
    "lr": 1e-3,
    "min-lr": 1e-4,
    "lr-warmup-iters": 2,
    "log-interval": 1000,
}


def _argv(**options) -> list[str]:
    """argv for parse_args: TINY updated by ``options`` (True: a bare flag, None: left out)."""
    return argv_of(TINY, **options)


def _train(argv: list[str]) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    result = train(parse_args(argv))
    state = {k: v.detach().clone() for k, v in result.model.state_dict().items() if v is not None}
    return result.losses, state


# --- pure argument checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_layers_per_virtual_pipeline_stage": 1}, "needs --pipeline-model-parallel-size"),
        ({"hidden_dropout": 1.5}, "must be in [0, 1)"),
        ({"save_interval": 5}, "needs --save"),
        ({"ckpt_step": 3}, "needs --load DIR and must be >= 0"),
        ({"lr": 1e-3, "min_lr": 1e-2}, "--min-lr"),
    ],
)
def test_parse_args_rejects(options, message):
    with pytest.raises(MegatronCoreError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse_args(_argv(**options))


def test_validate_args_world_size_and_batch():
    with pytest.raises(MegatronCoreError, match=r"world size \(3\) must be divisible"):
        validate_args(parse_args(_argv(tensor_model_parallel_size=2)), 3)
    with pytest.raises(MegatronCoreError, match=r"--global-batch-size \(6\) must be a multiple"):
        validate_args(parse_args(_argv(tensor_model_parallel_size=1, global_batch_size=6)), 2)
    with pytest.raises(MegatronCoreError, match=r"--seq-length \(15\) must be divisible"):
        validate_args(
            parse_args(_argv(seq_length=15, sequence_parallel=True, tensor_model_parallel_size=2)),
            2,
        )
    args = parse_args(_argv(tensor_model_parallel_size=1, micro_batch_size=3))
    validate_args(args, 4)
    assert args.global_batch_size == 12  # micro batch * data-parallel size


@pytest.mark.parametrize(
    "world_size, heads, sequence_parallel, expected",
    [
        (1, 4, False, 1),
        (2, 4, False, 2),
        (4, 4, False, 4),
        (3, 4, False, 1),
        (8, 4, False, 4),
        (6, 6, False, 6),
        (4, 6, False, 2),
        (4, 4, True, 4),
    ],
)
def test_default_tp_is_the_largest_that_fits(world_size, heads, sequence_parallel, expected):
    # hidden 48 and seq 16 keep every size up to 6 but 5 splittable; heads decide
    args = parse_args(
        _argv(num_attention_heads=heads, hidden_size=48, sequence_parallel=sequence_parallel)
    )
    assert args.tensor_model_parallel_size is None
    validate_args(args, world_size)
    assert args.tensor_model_parallel_size == expected


def test_layout_errors_name_the_flag_and_the_sizes_that_fit():
    with pytest.raises(MegatronCoreError, match=r"use --tensor-model-parallel-size 1 or 2 or 4$"):
        validate_args(parse_args(_argv(tensor_model_parallel_size=3)), 4)
    message = r"--num-attention-heads \(4\) must be divisible by --tensor-model-parallel-size \(3\)"
    with pytest.raises(MegatronCoreError, match=message):
        validate_args(parse_args(_argv(tensor_model_parallel_size=3)), 3)
    with pytest.raises(MegatronCoreError, match=r"unrecognized arguments: --bogus \(see"):
        parse_args(["--bogus"])
    with pytest.raises(MegatronCoreError, match=r"--distributed-timeout-minutes \(0.0\)"):
        parse_args(["--distributed-timeout-minutes", "0"])


def test_recompute_options_are_checked_before_any_process():
    args = parse_args(_argv(recompute_method="uniform", tensor_model_parallel_size=1))
    with pytest.raises(MegatronCoreError, match="needs recompute_granularity='full'"):
        model_config(args)


def test_sequence_parallel_on_one_tp_rank_is_switched_off_with_a_warning():
    args = parse_args(_argv(tensor_model_parallel_size=1, sequence_parallel=True))
    with pytest.warns(UserWarning, match="disabling sequence parallelism"):
        config = model_config(args)
    assert not config.sequence_parallel
    args = parse_args(_argv(sequence_parallel=True, tensor_model_parallel_size=2))
    assert model_config(args).sequence_parallel


def test_learning_rate_warmup_then_cosine_to_min():
    args = parse_args(_argv(lr=1.0, min_lr=0.1, lr_warmup_iters=4, train_iters=14))
    assert [learning_rate(args, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(args, 14) == pytest.approx(0.1)
    assert learning_rate(args, 9) == pytest.approx(0.55)


def test_corpus_batches_depend_only_on_seed_and_iteration(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 4)
    corpus = ByteCorpus.load(str(path), 16)
    a, b = corpus.global_batch(3, 4, 16, 1), corpus.global_batch(3, 4, 16, 1)
    assert a.shape == (4, 17) and torch.equal(a, b)
    assert not torch.equal(a, corpus.global_batch(4, 4, 16, 1))
    assert torch.equal((a[:, 1:] - a[:, :-1]) % 256, torch.ones(4, 16, dtype=torch.long))
    with pytest.raises(MegatronCoreError, match="cannot read"):
        ByteCorpus.load(str(tmp_path / "missing.txt"), 16)
    with pytest.raises(MegatronCoreError, match="needs --seq-length"):
        ByteCorpus.load(str(path), 5000)
    assert len(ByteCorpus.load(None, 16)) > 10_000  # the default corpus ships with the package


# --- TP equivalence -----------------------------------------------------------------------------


def _losses(argv):
    return _train(argv)[0]


def test_tp1_tp2_sp_and_dp_give_the_same_losses():
    """Dropout 0, 20 steps. Every layout sees the same global batch of 4 sequences per step.

    Tolerance 1e-5 relative: the layouts compute the same sums in another order (partial sums
    per rank, then a reduction), fp32 rounding that AdamW carries through 20 steps.
    """
    common = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "train_iters": 20}
    reference = run_distributed(
        _losses, 1, _argv(tensor_model_parallel_size=1, micro_batch_size=4, **common)
    )[0]
    layouts = {
        "tp1 + 2 microbatches": (
            1,
            _argv(tensor_model_parallel_size=1, global_batch_size=4, **common),
        ),
        "tp2": (2, _argv(tensor_model_parallel_size=2, micro_batch_size=4, **common)),
        "tp2 + sp": (
            2,
            _argv(
                tensor_model_parallel_size=2, micro_batch_size=4, sequence_parallel=True, **common
            ),
        ),
        "tp1 x dp2": (2, _argv(tensor_model_parallel_size=1, micro_batch_size=2, **common)),
        "tp2, unfused attention": (  # the reference runs the fused core (no attention dropout)
            2,
            _argv(
                tensor_model_parallel_size=2, micro_batch_size=4, attention_backend="unfused",
                **common,
            ),
        ),  # fmt: skip
        "tp2 x dp2 + sp": (
            4,
            _argv(
                tensor_model_parallel_size=2, micro_batch_size=2, sequence_parallel=True, **common
            ),
        ),
    }
    values = torch.tensor([reference[i] for i in range(1, 21)], dtype=torch.float64)
    assert values[-5:].mean() < values[:5].mean()  # it learns
    for name, (world_size, argv) in layouts.items():
        per_rank = run_distributed(_losses, world_size, argv)
        for losses in per_rank:
            got = torch.tensor([losses[i] for i in range(1, 21)], dtype=torch.float64)
            torch.testing.assert_close(got, values, rtol=1e-5, atol=0, msg=name)


# --- recompute is bitwise ---------------------------------------------------------------------


RECOMPUTE_VARIANTS = {
    "selective": {"recompute_granularity": "selective"},
    "full uniform 1": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full uniform 2 distributed": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 2,
        "distribute_saved_activations": True,
    },
    "full block 1": {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 1,
    },
}


def _recompute_runs(sequence_parallel: bool):
    common = {
        "hidden_dropout": 0.2,
        "attention_dropout": 0.2,
        "train_iters": 6,
        "tensor_model_parallel_size": 2,
        "sequence_parallel": sequence_parallel,
    }
    runs = {"none": _train(_argv(**common))}
    for name, options in RECOMPUTE_VARIANTS.items():
        if sequence_parallel and options.get("distribute_saved_activations"):
            continue  # not allowed with sequence parallelism
        runs[name] = _train(_argv(**common, **options))
    return runs


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_recompute_gives_bitwise_the_same_training(sequence_parallel):
    """Dropout 0.2 on CPU: every recompute variant replays the same masks, so losses and final
    parameters are bitwise those of the run without recompute."""
    for runs in run_distributed(_recompute_runs, 2, sequence_parallel):
        losses, params = runs.pop("none")
        for name, (other_losses, other_params) in runs.items():
            assert other_losses == losses, name
            for key in params:
                assert torch.equal(other_params[key], params[key]), (name, key)


# --- own data -----------------------------------------------------------------------------------


def _train_on_file(path: str):
    return _losses(_argv(tensor_model_parallel_size=1, train_iters=3, data=path))


def test_data_path_trains_on_the_given_file(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    (losses,) = run_distributed(_train_on_file, 1, str(path))
    assert sorted(losses) == [1, 2, 3]


# --- the torchrun command itself ------------------------------------------------------------


def test_torchrun_main_job_runs(tmp_path):
    # ``python -m torch.distributed.run`` is the torchrun command, run by this interpreter.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "scripts" / "train_gpt.py"),
        "--train-iters",
        "6",
        "--log-interval",
        "3",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--save",
        str(tmp_path / "ckpt"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "iteration      6/6" in done.stdout and "done: iterations 1-6" in done.stdout, (
        done.stdout
    )
    assert (tmp_path / "ckpt" / TRACKER_FILENAME).read_text().strip() == "6"
