"""--bf16 / --fp16 training (megatron_core/training/mixed_precision.py) and its loss scaler.

End-to-end checks run the tiny GPT of test_train_gpt.py through ``train`` for 50 iterations:
- bf16 tracks fp32 at TP 1 and at TP 2 with sequence parallelism. Tolerance: 0.02 nats per
  iteration. The runs share weights (bf16 = the fp32 init rounded), batches and dropout masks;
  bf16 rounds weights to 8 significant bits (relative 2^-9 = 2e-3) and activations likewise, so
  the loss of a ~5.5-nat byte model moves by a few 1e-3 nats;
  scripts/benchmarks/precision_drift.py measured at most 0.003-0.006 on this model
  (docs/benchmarks/), and 0.02 leaves headroom for the optimizer trajectories to separate over
  50 steps while still catching a broken main-grad or master-weight path (a step lost, a grad
  in bf16 accumulation, or a stale weight copy gives >= 0.05 within a few steps at lr 1e-3).
- bf16 at TP 1 and TP 2 agree to the same 0.02.
- fp16 (loss scale 2^10: no overflow on this model) tracks fp32 to the same 0.02 (fp16 keeps
  11 significant bits: its drift is ~10x smaller than bf16's).
- fp16 with a loss scale large enough to overflow skips iterations (counted), backs the scale
  off, and still trains (losses finite, the last 10 well below the first 10).
- bf16 resume: save at iteration 3, load, finish at 6 == 6 uninterrupted iterations, bitwise
  (losses, model weights, fp32 main weights, optimizer state).
"""

import math

import pytest
import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed
from megatron_core.training import parse_args, train
from megatron_core.training.mixed_precision import DynamicLossScaler, MixedPrecisionOptimizer

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-warmup-iters", "2", "--log-interval", "1000",
    "--hidden-dropout", "0", "--attention-dropout", "0",  # TP 1 and TP 2 draw other masks
]  # fmt: skip
DRIFT_TOL = 0.02  # nats per iteration; see the module doc


def _losses(argv):
    result = train(parse_args(argv))
    optimizer = result.optimizer
    return result.losses, getattr(optimizer, "skipped_iterations", 0)


def _tp(tp):
    return ["--tensor-model-parallel-size", str(tp)] + (["--sequence-parallel"] if tp > 1 else [])


@pytest.fixture(scope="module")
def runs():
    """50-iteration losses: {(precision, tp): {iteration: loss}} (dropout off, see TINY)."""
    out = {}
    for tp in (1, 2):
        for precision in ("fp32", "bf16", "fp16"):
            flags = [] if precision == "fp32" else [f"--{precision}"]
            if precision == "fp16":  # 2^16 overflows twice on this tiny model; 2^10 never
                flags += ["--initial-loss-scale", "1024"]
            argv = [*TINY, *_tp(tp), "--train-iters", "50", *flags]
            losses, skipped = run_distributed(_losses, tp, argv, timeout=600)[0]
            assert skipped == 0, f"{precision} at TP {tp} skipped {skipped} iterations"
            out[precision, tp] = losses
    return out


def _max_drift(a, b):
    assert a.keys() == b.keys() and len(a) == 50
    return max(abs(a[i] - b[i]) for i in a)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_half_precision_tracks_fp32(runs, tp, precision):
    drift = _max_drift(runs[precision, tp], runs["fp32", tp])
    assert drift < DRIFT_TOL, f"{precision} vs fp32 at TP {tp}: max drift {drift:.4f} nats"
    assert runs[precision, tp] != runs["fp32", tp]  # it really ran in half precision


def test_bf16_tp1_and_tp2_agree(runs):
    drift = _max_drift(runs["bf16", 1], runs["bf16", 2])
    assert drift < DRIFT_TOL, f"bf16 TP 1 vs TP 2: max drift {drift:.4f} nats"


def test_fp16_overflow_skips_iterations_and_recovers(runs):
    # 2^30 overflows fp16 gradients (max 65504) at once; hysteresis 1 halves the scale per skip.
    argv = [*TINY, *_tp(1), "--train-iters", "50", "--fp16"]
    argv += ["--initial-loss-scale", str(2.0**30), "--hysteresis", "1"]
    losses, skipped = run_distributed(_losses, 1, argv, timeout=600)[0]
    assert 5 <= skipped < 30, f"{skipped} skipped iterations"
    assert all(math.isfinite(v) for v in losses.values())
    # It still learns after the skips: the last 10 losses are well below the first 10.
    first, last = [losses[i] for i in range(1, 11)], [losses[i] for i in range(41, 51)]
    assert sum(last) / 10 < sum(first) / 10 - 0.3, (first, last)


def _resume(argv_first, argv_second):
    first = train(parse_args(argv_first))
    second = train(parse_args(argv_second))
    return _snapshot(first) | {"resumed": _snapshot(second)}


def _snapshot(result):
    opt = result.optimizer.state_dict()
    return {
        "losses": result.losses,
        "model": {
            k: v.detach().clone()
            for k, v in result.model.state_dict().items()
            if isinstance(v, torch.Tensor)
        },
        "main_params": opt["main_params"],
        "adam": {i: {k: v.clone() for k, v in s.items()} for i, s in opt["state"].items()},
    }


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_is_bitwise(tmp_path, precision):
    base = [*TINY, *_tp(2), "--train-iters", "6", f"--{precision}"]
    save = [*base, "--save", str(tmp_path), "--exit-interval", "3"]
    load = [*base, "--load", str(tmp_path)]
    uninterrupted = run_distributed(_resume_reference, 2, base, timeout=600)[0]
    got = run_distributed(_resume, 2, save, load, timeout=600)[0]["resumed"]
    assert got["losses"] == {i: uninterrupted["losses"][i] for i in (4, 5, 6)}
    for what in ("model", "main_params", "adam"):
        ref, new = uninterrupted[what], got[what]
        assert ref.keys() == new.keys()
        for key in ref:
            if isinstance(ref[key], dict):
                for k in ref[key]:
                    torch.testing.assert_close(new[key][k], ref[key][k], rtol=0, atol=0)
            else:
                torch.testing.assert_close(new[key], ref[key], rtol=0, atol=0)
    main = got["main_params"]
    assert all(t.dtype == torch.float32 for t in main.values())


def _resume_reference(argv):
    return _snapshot(train(parse_args(argv)))


def test_bf16_and_fp16_exclude_each_other():
    with pytest.raises(MegatronCoreError, match="--bf16 and --fp16"):
        parse_args(["--bf16", "--fp16"])
    with pytest.raises(MegatronCoreError, match=r"--min-loss-scale \(8.0\)"):
        parse_args(["--fp16", "--initial-loss-scale", "4", "--min-loss-scale", "8"])


def test_loss_scaler_rules():
    scaler = DynamicLossScaler(1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 1024.0  # first overflow: hysteresis absorbs it
    scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(True)
    assert scaler.scale == 256.0  # hysteresis is not refilled until a growth
    scaler.update(True)
    assert scaler.scale == 256.0  # never below min_scale
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 512.0
    state = scaler.state_dict()
    other = DynamicLossScaler(1.0)
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(MegatronCoreError, match=r"backoff_factor \(2"):
        DynamicLossScaler(backoff_factor=2.0)


def test_optimizer_skips_on_overflow_and_keeps_fp32_main_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = MixedPrecisionOptimizer(inner, model, DynamicLossScaler(8.0, hysteresis=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    opt.scale_loss(model(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
    assert model.weight.grad is None and model.weight.main_grad.dtype == torch.float32
    main = opt.prepare_grads()
    torch.testing.assert_close(main[0].grad, torch.full((3, 4), 2.0))  # unscaled: 8x / 8
    main[0].grad[0, 0] = float("inf")
    assert opt.step() is False and opt.skipped_iterations == 1 and opt.loss_scale == 4.0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    opt.zero_grad()
    opt.scale_loss(model(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
    opt.prepare_grads()
    assert opt.step() is True
    # The main weight took an exact fp32 step; the model holds it rounded to fp16.
    expected = before["weight"].float() - 0.1 * 2.0
    torch.testing.assert_close(opt.main_module[0].detach(), expected, rtol=0, atol=0)
    torch.testing.assert_close(model.weight.detach(), expected.half(), rtol=0, atol=0)


def test_optimizer_refuses_fp32_params_and_mismatched_state():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(MegatronCoreError, match="torch.float32"):
        MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    half = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(half.parameters(), lr=0.1), half)
    state = opt.state_dict()
    assert set(state["main_params"]) == {"weight", "bias"}
    with pytest.raises(MegatronCoreError, match="main_params"):
        opt.load_state_dict({**state, "main_params": {"weight": state["main_params"]["weight"]}})
    with pytest.raises(MegatronCoreError, match="loss_scaler"):
        opt.load_state_dict({**state, "loss_scaler": DynamicLossScaler().state_dict()})


def test_checkpoint_hooks_round_trip():
    """The hooks training/checkpoint.py's DCP path calls (NOTE [ Checkpoint keys ], rule 4)."""
    model = torch.nn.Linear(4, 3).to(torch.float16)
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, DynamicLossScaler(64.0, hysteresis=1)
    )
    pairs = opt.checkpoint_param_pairs()
    assert [p for p, _ in pairs] == list(model.parameters())
    assert all(m.dtype == torch.float32 and m.shape == p.shape for p, m in pairs)
    opt.loss_scaler.update(True)
    opt.skipped_iterations = 3
    extra = opt.checkpoint_extra_state()
    other = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, DynamicLossScaler(1024.0)
    )
    other.load_checkpoint_extra_state(extra)
    assert other.loss_scale == 32.0 and other.skipped_iterations == 3
    assert other.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
    bf16 = torch.nn.Linear(4, 3).to(torch.bfloat16)
    no_scaler = MixedPrecisionOptimizer(torch.optim.SGD(bf16.parameters(), lr=0.1), bf16)
    assert no_scaler.checkpoint_extra_state() == {}
    with pytest.raises(MegatronCoreError, match="--fp16 and --bf16 checkpoints do not mix"):
        no_scaler.load_checkpoint_extra_state(extra)
