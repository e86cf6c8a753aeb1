"""Training checkpoints (megatron_core.training.checkpoint): exact resume, resharding across TP/DP
sizes, atomic saves, and clear failures on damaged checkpoints.

Every check trains a tiny GPT (2 layers, hidden 32, sequence 16) through ``train(args)`` inside
``run_distributed`` and compares with an uninterrupted run from the same seed.
"""

import errno
import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _train_args import argv_of, corpus_file

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_core.testing import DistributedTestError, run_distributed
from megatron_core.training import (
    MANIFEST_FILENAME,
    TRACKER_FILENAME,
    ByteCorpus,
    build_model_and_optimizer,
    load_checkpoint,
    model_config,
    parse_args,
    save_checkpoint,
    train,
    train_step,
    validate_args,
)

TINY = {
    "data": corpus_file(),
    "num-layers": 2,
    "hidden-size": 32,
    "num-attention-heads": 4,
    "seq-length": 16,
    "micro-batch-size": 1,
    "global-batch-size": 4,
    "lr": 1e-3,
    "min-lr": 1e-4,
    "lr-warmup-iters": 2,
    "log-interval": 1000,
}
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def _argv(**options) -> list[str]:
    """argv for parse_args: TINY updated by ``options`` (True: a bare flag, None: left out)."""
    return argv_of(TINY, **options)


def _train(argv: list[str]):
    result = train(parse_args(argv))
    params = {k: v.detach().clone() for k, v in result.model.state_dict().items() if v is not None}
    return result.losses, params


def _losses(argv: list[str]):
    return _train(argv)[0]


# --- exact resume at the same layout --------------------------------------------------------


def _resume(directory: str, tp: int):
    common = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "tensor_model_parallel_size": tp}
    straight_losses, straight_params = _train(_argv(train_iters=10, **common))
    first, _ = _train(_argv(train_iters=10, exit_interval=5, save=directory, **common))
    resumed_losses, resumed_params = _train(_argv(train_iters=10, load=directory, **common))
    return straight_losses, straight_params, first, resumed_losses, resumed_params


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "tp1 x dp2"])
def test_resume_continues_bitwise(tmp_path, tp):
    """10 iterations straight == 5, save, load, 5 more: the same losses and parameters, bit for
    bit (dropout 0.1, so every rank's RNG state must be restored too)."""
    for straight, params, first, resumed, resumed_params in run_distributed(
        _resume, 2, str(tmp_path), tp
    ):
        assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [6, 7, 8, 9, 10]
        assert {**first, **resumed} == straight
        for key in params:
            assert torch.equal(resumed_params[key], params[key]), key
    assert (tmp_path / TRACKER_FILENAME).read_text().strip() == "5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", TRACKER_FILENAME]


# --- resharding -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """A TP=2 checkpoint at iteration 5 of 10 (dropout 0) and the uninterrupted TP=2 losses."""
    directory = str(tmp_path_factory.mktemp("tp2"))
    common = {"tensor_model_parallel_size": 2, "train_iters": 10, **NO_DROPOUT}
    straight = run_distributed(_losses, 2, _argv(**common))[0]
    run_distributed(_losses, 2, _argv(exit_interval=5, save=directory, **common))
    return directory, straight


@pytest.mark.parametrize(
    "world_size, options",
    [
        (1, {"tensor_model_parallel_size": 1}),
        (2, {"tensor_model_parallel_size": 1}),
        (4, {"tensor_model_parallel_size": 4}),
        (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    ],
    ids=["tp1", "tp1 x dp2", "tp4 (vocab padded to 512)", "tp2 x dp2 + sp"],
)
def test_tp2_checkpoint_loads_at_other_layouts_with_the_same_losses(
    tp2_checkpoint, world_size, options
):
    """Iterations 6-10 after loading the TP=2 checkpoint at another layout match the
    uninterrupted TP=2 run. Tolerance 1e-5 relative: the layouts add the same numbers in another
    order (per-rank partial sums, then a reduction), fp32 rounding carried through 5 AdamW
    steps (the same tolerance as the layout-equivalence test)."""
    directory, straight = tp2_checkpoint
    argv = _argv(train_iters=10, load=directory, **NO_DROPOUT, **options)
    for losses in run_distributed(_losses, world_size, argv):
        assert sorted(losses) == [6, 7, 8, 9, 10]
        got = torch.tensor([losses[i] for i in range(6, 11)], dtype=torch.float64)
        want = torch.tensor([straight[i] for i in range(6, 11)], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def _save_then_overwrite(directory: str):
    """TP=1 (world 1) saves iteration 3 into a directory holding a TP=2 iteration 3."""
    return _losses(_argv(train_iters=3, save=directory, tensor_model_parallel_size=1, **NO_DROPOUT))


def _load_layout(directory: str):
    args = parse_args(_argv(tensor_model_parallel_size=2))
    validate_args(args, dist.get_world_size())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(args.seed)
    model, optimizer = build_model_and_optimizer(args, model_config(args))
    return load_checkpoint(directory, model, optimizer).layout


def test_a_save_replaces_another_layouts_checkpoint_whole(tmp_path):
    directory = str(tmp_path)
    run_distributed(_losses, 2, _argv(train_iters=3, save=directory, tensor_model_parallel_size=2))
    tp2_files = set(os.listdir(tmp_path / "iter_0000003"))
    run_distributed(_save_then_overwrite, 1, directory)
    iteration_dir = tmp_path / "iter_0000003"
    manifest = json.loads((iteration_dir / MANIFEST_FILENAME).read_text())
    assert manifest["layout"]["tp_size"] == 1 and manifest["layout"]["world_size"] == 1
    # exactly the TP=1 save's files: none of the TP=2 save's rank-1 files survive
    assert set(os.listdir(iteration_dir)) == {*manifest["files"], MANIFEST_FILENAME}
    assert "__1_0.distcp" in tp2_files and "__1_0.distcp" not in os.listdir(iteration_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", TRACKER_FILENAME]
    for layout in run_distributed(_load_layout, 2, directory):
        assert layout["tp_size"] == 1  # the TP=1 checkpoint, resharded into TP=2


def _changed_schedule(directory: str):
    import warnings

    _losses(_argv(train_iters=4, exit_interval=2, save=directory, tensor_model_parallel_size=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _losses(_argv(train_iters=6, load=directory, tensor_model_parallel_size=1))
    return [str(w.message) for w in caught]


def test_load_with_changed_schedule_warns_with_old_and_new_values(tmp_path):
    (messages,) = run_distributed(_changed_schedule, 1, str(tmp_path))
    assert any(
        m.startswith("--train-iters is 6, the checkpoint was trained with 4") for m in messages
    ), messages


# --- damaged checkpoints ----------------------------------------------------------------------


def _fresh(tp: int, hidden: int = 32, **options):
    args = parse_args(_argv(tensor_model_parallel_size=tp, hidden_size=hidden, **options))
    validate_args(args, dist.get_world_size())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(args.seed)
    return build_model_and_optimizer(args, model_config(args))


def _failed_load(directory: str, tp: int = 2, hidden: int = 32):
    """Load ``directory`` into a fresh model; returns (error message, nothing changed)."""
    model, optimizer = _fresh(tp, hidden)
    before = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    rng_before = torch.get_rng_state()
    try:
        load_checkpoint(directory, model, optimizer)
        message = None
    except MegatronCoreError as exc:
        message = str(exc)
    unchanged = all(torch.equal(before[k], model.state_dict()[k]) for k in before)
    unchanged = unchanged and not optimizer.state and torch.equal(rng_before, torch.get_rng_state())
    parallel_state.destroy_model_parallel()
    return message, unchanged


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _damage(directory: Path, case: str) -> None:
    iteration = directory / "iter_0000002"
    manifest_path = iteration / MANIFEST_FILENAME
    manifest = json.loads(manifest_path.read_text())
    shard = iteration / "__1_0.distcp"
    if case == "flipped bytes":
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle - 2000 : middle + 2000] = bytes(
            255 - b for b in data[middle - 2000 : middle + 2000]
        )
        shard.write_bytes(bytes(data))
    elif case == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif case == "missing":
        shard.unlink()
    elif case in ("pickled code in metadata", "random metadata", "persistent id in metadata"):
        payload = {
            "pickled code in metadata": pickle.dumps(_Evil()),
            "random metadata": random.Random(0).randbytes(3000),  # the same bytes every run
            # pickle's error for this one spans two lines; the message must still be one
            "persistent id in metadata": b"P0\n.",
        }[case]
        (iteration / ".metadata").write_bytes(payload)
        import hashlib

        manifest["files"][".metadata"] = {
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        manifest_path.write_text(json.dumps(manifest))  # a consistent manifest: the reader checks
    elif case in ("unlisted shard", "shard not covered"):  # the entry goes, valid JSON stays
        del manifest["files"]["__1_0.distcp"]
        manifest_path.write_text(json.dumps(manifest))
        if case == "shard not covered":
            shard.unlink()  # .metadata still names it
    elif case == "stray file":
        (iteration / "notes.txt").write_text("not part of the checkpoint")
    elif case == "bad manifest":
        manifest_path.write_text("{not json")
    elif case == "no tracker":
        (directory / TRACKER_FILENAME).unlink()


DAMAGE = {
    "flipped bytes": "__1_0.distcp is corrupt: its SHA-256 does not match the manifest",
    "truncated": "__1_0.distcp is 100 bytes, the manifest says",
    "missing": "__1_0.distcp is missing",
    "pickled code in metadata": "posix.system is not allowed in checkpoint metadata",
    "random metadata": ".metadata is unreadable",
    "persistent id in metadata": ".metadata is unreadable (UnpicklingError: A load persistent id",
    "bad manifest": "manifest.json is unreadable",
    "no tracker": f"{TRACKER_FILENAME} does not exist",
    "unlisted shard": "__1_0.distcp is not listed in manifest.json",
    "shard not covered": "__1_0.distcp is named by .metadata but not covered by manifest.json",
    "stray file": "notes.txt is not listed in manifest.json",
}


def _damaged_loads(directory: str):
    root = Path(directory)
    _losses(_argv(train_iters=2, tensor_model_parallel_size=2, save=directory))
    pristine = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    results = {"other model": _failed_load(directory, hidden=64)}
    for case in DAMAGE:
        dist.barrier()
        if dist.get_rank() == 0:
            for path, data in pristine.items():
                path.write_bytes(data)
            _damage(root, case)
        dist.barrier()
        results[case] = _failed_load(directory)
    return results


def test_damaged_checkpoints_fail_with_one_clear_error_on_every_rank_and_touch_nothing(tmp_path):
    os.chdir(tmp_path)  # where the pickled os.system would create "pwned"
    per_rank = run_distributed(_damaged_loads, 2, str(tmp_path / "ckpt"))
    expected = {
        **DAMAGE,
        "other model": "model.embedding.weight is [256, 32] in the checkpoint, "
        "[256, 64] in this model",
    }
    for case, text in expected.items():
        messages = {rank_results[case][0] for rank_results in per_rank}
        assert len(messages) == 1, (case, messages)  # every rank: the same error
        (message,) = messages
        assert message is not None and text in message, (case, message)
        assert message.startswith("loading checkpoint from"), message
        assert "weights_only" not in message and "\n" not in message, message
        for rank_results in per_rank:
            assert rank_results[case][1], f"{case}: a rank's model, optimizer or RNG changed"
    assert not (tmp_path / "pwned").exists()


def test_other_model_configuration_is_named_by_its_flag(tmp_path):
    directory = str(tmp_path)
    run_distributed(_losses, 1, _argv(train_iters=1, save=directory, tensor_model_parallel_size=1))
    with pytest.raises(
        DistributedTestError, match=r"trained with --hidden-size 32 \(this run: 64\)"
    ):
        run_distributed(_losses, 1, _argv(train_iters=2, load=directory, hidden_size=64))
    # Resolved values are compared: no --ffn-hidden-size means 4 * hidden = 128.
    with pytest.raises(
        DistributedTestError, match=r"trained with --ffn-hidden-size 128 \(this run: 64\)"
    ):
        run_distributed(_losses, 1, _argv(train_iters=2, load=directory, ffn_hidden_size=64))
    (losses,) = run_distributed(
        _losses, 1, _argv(train_iters=2, load=directory, ffn_hidden_size=128)
    )
    assert sorted(losses) == [2]


def test_an_unregistered_complete_checkpoint_is_named_with_the_flag_that_loads_it(tmp_path):
    """A first save stopped after its directory was complete, before the tracker was written."""
    directory = str(tmp_path)
    run_distributed(_losses, 1, _argv(train_iters=2, save=directory, tensor_model_parallel_size=1))
    (tmp_path / TRACKER_FILENAME).unlink()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_losses, 1, _argv(train_iters=3, load=directory))
    (failure,) = info.value.failures.values()
    assert f"no checkpoint in {directory}" in failure.message, failure.message
    assert f"{tmp_path / 'iter_0000002'} is a complete checkpoint" in failure.message
    assert "--ckpt-step 2" in failure.message, failure.message
    (losses,) = run_distributed(_losses, 1, _argv(train_iters=3, load=directory, ckpt_step=2))
    assert sorted(losses) == [3]


# --- interrupted and failing saves ------------------------------------------------------------


class _FullDisk:
    """A DCP output stream that fails after 4 KiB, as a full disk does (``write`` raises
    ENOSPC; torch.save then reports "unexpected pos ..."), or whose process is killed there."""

    def __init__(self, stream, failure: str):
        self._stream, self._failure, self._written = stream, failure, 0

    def write(self, data) -> int:
        self._written += len(memoryview(data).cast("B"))
        if self._written > 4096:
            if self._failure == "killed":
                os._exit(1)  # no cleanup of any kind
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _failing_writer(failure: str):
    """On global rank 1, DCP's shard files fail part-way through (see :class:`_FullDisk`)."""
    import contextlib

    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            failing = dist.get_rank() == 1 and str(path).endswith(".distcp")
            yield _FullDisk(stream, failure) if failing else stream

    filesystem.FileSystem.create_stream = create_stream
    return original


def _save_twice_second_fails(directory: str, failure: str):
    """Iteration 2 saves fine; the save at iteration 4 fails on rank 1."""
    argv = _argv(train_iters=4, save=directory, save_interval=2, tensor_model_parallel_size=1)
    from torch.distributed.checkpoint import filesystem

    from megatron_core.training import resume  # the main job's save/resume

    original, create_stream = resume.save_checkpoint, filesystem.FileSystem.create_stream
    calls = []

    def second_save_fails(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            _failing_writer(failure)
        return original(*args, **kwargs)

    resume.save_checkpoint = second_save_fails
    try:
        train(parse_args(argv))
    except MegatronCoreError as exc:
        return str(exc)
    finally:  # these workers serve later tests
        resume.save_checkpoint, filesystem.FileSystem.create_stream = original, create_stream
    return None


def _resume_losses(directory: str):
    argv = _argv(train_iters=4, load=directory, save=directory, tensor_model_parallel_size=1)
    return _losses(argv)


def test_disk_full_during_save_fails_on_every_rank_and_leaves_no_temporary_files(tmp_path):
    messages = run_distributed(_save_twice_second_fails, 2, str(tmp_path), "disk full")
    assert len(set(messages)) == 1, messages  # every rank: the same error
    message = messages[0]
    assert message is not None and "No space left on device" in message, message
    assert "rank 1: OSError: [Errno 28] No space left on device" in message, message
    assert "unexpected pos" not in message, message  # torch.save's text for the short write
    assert message.startswith(f"saving checkpoint {tmp_path / 'iter_0000004'} failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", TRACKER_FILENAME]
    assert (tmp_path / TRACKER_FILENAME).read_text().strip() == "2"
    (losses,) = run_distributed(_resume_losses, 1, str(tmp_path))
    assert sorted(losses) == [3, 4]


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    with pytest.raises(DistributedTestError):
        run_distributed(_save_twice_second_fails, 2, str(tmp_path), "killed", timeout=120)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".iter_0000004.partial", "iter_0000002", TRACKER_FILENAME], names
    assert (tmp_path / TRACKER_FILENAME).read_text().strip() == "2"
    (losses,) = run_distributed(_resume_losses, 1, str(tmp_path))  # loads iteration 2, saves 4
    assert sorted(losses) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000002",
        "iter_0000004",
        TRACKER_FILENAME,
    ]


# --- optimizers with fp32 master weights and extra state ---------------------------------------


class _MasterWeightOptimizer:
    """A stand-in for a mixed-precision optimizer (NOTE [ Checkpoint keys ], rule 4): AdamW
    steps fp32 copies of the parameters, and a loss scale grows every step."""

    def __init__(self, params, **kwargs):
        self.params = list(params)
        self.masters = [p.detach().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, **kwargs)
        self.param_groups = self.optimizer.param_groups
        self.loss_scale = torch.tensor(1024.0)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        for p, master in zip(self.params, self.masters):
            master.grad = p.grad
        self.optimizer.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                p.copy_(master)
        self.loss_scale *= 2

    def checkpoint_param_pairs(self):
        return list(zip(self.params, self.masters))

    def checkpoint_extra_state(self):
        return {"loss_scale": self.loss_scale}

    def load_checkpoint_extra_state(self, extra):
        self.loss_scale.copy_(extra["loss_scale"])


def _master_run(directory: str, tp: int, phase: str):
    """phase "straight": 4 steps; "save": 2 steps then save; "load": load, then steps 3-4."""
    args = parse_args(_argv(tensor_model_parallel_size=tp, train_iters=4, **NO_DROPOUT))
    model, _ = _fresh(tp, **NO_DROPOUT)
    optimizer = _MasterWeightOptimizer(model.parameters(), lr=1e-3)
    corpus = ByteCorpus.load(args.data, args.seq_length)
    start = 0
    if phase == "load":
        start = load_checkpoint(directory, model, optimizer).iteration
    losses = {}
    for step in range(start, 2 if phase == "save" else 4):
        losses[step + 1] = train_step(model, optimizer, corpus, args, step)[0]
    if phase == "save":
        save_checkpoint(directory, 2, model, optimizer, {})
    return losses, optimizer.loss_scale.item()


@pytest.mark.parametrize("load_tp", [2, 1], ids=["same layout", "resharded to tp1"])
def test_master_weights_and_extra_state_are_saved_and_resharded(tmp_path, load_tp):
    """Tolerance 1e-5 relative, as for the other reshard test; bitwise at the same layout."""
    straight, scale = run_distributed(_master_run, 2, str(tmp_path), 2, "straight")[0]
    run_distributed(_master_run, 2, str(tmp_path), 2, "save")
    resumed, resumed_scale = run_distributed(_master_run, load_tp, str(tmp_path), load_tp, "load")[
        0
    ]
    assert sorted(resumed) == [3, 4] and resumed_scale == scale == 1024.0 * 2**4
    got = torch.tensor([resumed[3], resumed[4]], dtype=torch.float64)
    want = torch.tensor([straight[3], straight[4]], dtype=torch.float64)
    if load_tp == 2:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


# --- across pipeline sizes and with mixed precision -----------------------------------------


def _straight_then_resume(directory: str, save_options: dict, load_options: dict, phase: str):
    common = {"train_iters": 6, **NO_DROPOUT}
    if phase == "straight":
        return _losses(_argv(**common, **save_options))
    if phase == "save":
        return _losses(_argv(exit_interval=3, save=directory, **common, **save_options))
    return _losses(_argv(load=directory, **common, **load_options))


def _reshard(tmp_path, save_world, save_options, load_world, load_options):
    """(uninterrupted losses at the saving layout, losses 4-6 resumed at the loading layout)."""
    args = (str(tmp_path), save_options, load_options)
    straight = run_distributed(_straight_then_resume, save_world, *args, "straight")[0]
    run_distributed(_straight_then_resume, save_world, *args, "save")
    resumed = run_distributed(_straight_then_resume, load_world, *args, "load")[0]
    assert sorted(resumed) == [4, 5, 6]
    return (
        torch.tensor([straight[i] for i in (4, 5, 6)], dtype=torch.float64),
        torch.tensor([resumed[i] for i in (4, 5, 6)], dtype=torch.float64),
    )


PP2 = {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 1}
TP1 = {"tensor_model_parallel_size": 1}


@pytest.mark.parametrize(
    "save_world, save_options, load_world, load_options",
    [(2, PP2, 1, TP1), (1, TP1, 2, PP2), (2, PP2, 2, {"tensor_model_parallel_size": 2})],
    ids=["pp2 -> pp1", "pp1 -> pp2", "pp2 -> tp2"],
)
def test_checkpoints_reshard_across_pipeline_sizes(
    tmp_path, save_world, save_options, load_world, load_options
):
    """Layer keys are global (layer_offset), the tied embedding's last-stage copy is the same
    tensor: a pp=2 checkpoint loads at pp=1 or tp=2 and back. Tolerance 1e-5 relative, as for
    the TP reshard (fp32 sums in another order)."""
    want, got = _reshard(tmp_path, save_world, save_options, load_world, load_options)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_resume_is_bitwise_and_reshards(tmp_path, precision):
    """--bf16 / --fp16 keep fp32 main weights (and fp16 a loss scaler) in the optimizer: they
    are saved under optimizer.master.* / optimizer.extra.*, so the resume is bitwise at the same
    layout, and at tp=1 the losses follow the tp=2 run to half-precision rounding: the layouts
    round partial matmul sums to bf16/fp16 at different points, and the loss averages that over
    every token (measured: 3e-5 relative for bf16, 2e-6 for fp16; 1e-3 leaves margin)."""
    options = {"tensor_model_parallel_size": 2, precision: True}
    want, got = _reshard(tmp_path / "same", 2, options, 2, options)
    assert torch.equal(got, want)
    want, got = _reshard(tmp_path / "tp1", 2, options, 1, {**options, **TP1})
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
