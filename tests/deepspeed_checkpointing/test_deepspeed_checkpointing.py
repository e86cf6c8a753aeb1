"""megatron_core.deepspeed_checkpointing: DeepSpeed 0.19's names on this package's recompute.

Multi-rank bodies run with tp = world size (1, 2, 4) and mpu = parallel_state. Checkpointed runs
are compared with the plain run at the same tp with torch.equal (bitwise): on the CPU the
recompute runs the same kernels on the same values with the same RNG states, so any difference is
a bug (wrong dropout mask, wrong gather, lost padding). The plain run itself is compared with an
unsharded torch reference (same seed, dropout off) to rounding only, because the row-parallel
all-reduce sums the partial products in another order than one full matmul does.
"""

import json
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_core import deepspeed_checkpointing as ds
from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    count_saved_activations,
    get_rng_snapshot,
    reduce_from_tensor_model_parallel_region,
    set_rng_snapshot,
)
from megatron_core.testing import run_distributed

SEED = 1234
SHAPE = (3, 7, 5)  # 105 elements: neither tp=2 nor tp=4 divides it (padded chunks)
HIDDEN, FFN = 5, 8  # FFN splits over tp = 1, 2, 4
P = 0.3
WORLD_SIZES = [1, 2, 4]
GLOBALS = (
    "PARTITION_ACTIVATIONS",
    "CONTIGUOUS_CHECKPOINTING",
    "num_layers",
    "CPU_CHECKPOINT",
    "SYNCHRONIZE",
    "PROFILE_TIME",
    "mpu",
    "deepspeed_checkpointing_enabled",
)


class _Layer(nn.Module):
    """A tensor-parallel MLP block: f -> column-parallel linear -> dropout in the tracker fork ->
    gelu -> row-parallel linear -> g -> * scale + bias_in (no grad) -> dropout outside the fork.
    Returns a tuple with a non-tensor and an integer tensor, as DeepSpeed layers may."""

    def __init__(self, full):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        start = parallel_state.get_tensor_model_parallel_rank() * (FFN // tp)
        rows = slice(start, start + FFN // tp)
        w1, b1, w2, b2 = full
        self.w1, self.b1 = nn.Parameter(w1[rows].clone()), nn.Parameter(b1[rows].clone())
        self.w2, self.b2 = nn.Parameter(w2[:, rows].clone()), nn.Parameter(b2.clone())

    def forward(self, x, scale, tag, nothing, mask, p, bias_in=None):
        assert tag == "tag" and nothing is None  # non-tensor arguments stay in place
        h = F.linear(copy_to_tensor_model_parallel_region(x), self.w1, self.b1)
        with ds.get_cuda_rng_tracker().fork():
            h = F.dropout(h, p)
        h = reduce_from_tensor_model_parallel_region(F.linear(F.gelu(h), self.w2)) + self.b2
        h = (h * scale + bias_in).masked_fill(mask, 0.0)
        return F.dropout(h, p), "done", mask.sum()


def _reference(full_weights, x, scale, bias_in, mask):
    """The unsharded torch stack (dropout off)."""
    for w1, b1, w2, b2 in full_weights:
        h = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
        x = (h * scale + bias_in).masked_fill(mask, 0.0)
    return x


def _setup():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    ds.configure(parallel_state)
    ds.model_parallel_cuda_manual_seed(SEED)
    full = [
        (torch.randn(FFN, HIDDEN) / 2, torch.randn(FFN), torch.randn(HIDDEN, FFN) / 2,
         torch.randn(HIDDEN))
        for _ in range(3)
    ]  # fmt: skip
    layers = nn.ModuleList([_Layer(w) for w in full])
    # x is non-contiguous; scale has fewer elements than tp; bias_in does not require grad.
    x = torch.randn(SHAPE[2], SHAPE[1], SHAPE[0]).transpose(0, 2)
    scale, bias_in = torch.tensor([1.5]), torch.randn(SHAPE[1:])
    mask = torch.rand(SHAPE[1:]) > 0.8
    return full, layers, (x, scale, bias_in), mask


def _run(ckpt, layers, x, scale, bias_in, mask, p, as_kwargs):
    for layer in layers:
        if ckpt is None:
            out = layer(x, scale, "tag", None, mask, p, bias_in)
        elif as_kwargs:
            out = ckpt(layer, x, scale, "tag", None, mask=mask, p=p, bias_in=bias_in)
        else:
            out = ckpt(layer, x, scale, "tag", None, mask, p, bias_in)
        assert out[1] == "done" and out[2].dtype == torch.int64 and not out[2].requires_grad
        x = out[0]
    return x


def _step(ckpt, layers, inputs, mask, snapshot, p=P, as_kwargs=False):
    """Forward + backward from ``snapshot``: output, input and parameter grads, later draws."""
    set_rng_snapshot(snapshot)
    layers.zero_grad(set_to_none=True)
    x, scale = (t.detach().clone().requires_grad_() for t in inputs[:2])
    assert not x.is_contiguous()
    out = _run(ckpt, layers, x, scale, inputs[2], mask, p, as_kwargs)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    got = {"output": out.detach(), "grad of x": x.grad, "grad of scale": scale.grad}
    got.update({f"grad of {n}": t.grad for n, t in layers.named_parameters()})
    got["draw after"] = torch.rand(3)
    with ds.get_cuda_rng_tracker().fork():
        got["tracker draw after"] = torch.rand(3)
    return got


MODES = {
    "plain configure": {},
    "partition": {"partition_activations": True},
    "cpu": {"checkpoint_in_cpu": True},
    "partition + cpu": {"partition_activations": True, "checkpoint_in_cpu": True},
    "contiguous": {"partition_activations": True, "contiguous_checkpointing": True,
                   "num_checkpoints": 3},
    "synchronize + profile": {"synchronize": True, "profile": True},
    "everything": {"partition_activations": True, "contiguous_checkpointing": True,
                   "num_checkpoints": 3, "checkpoint_in_cpu": True, "synchronize": True,
                   "profile": True},
}  # fmt: skip


def _body_equivalence() -> list[str]:
    full, layers, inputs, mask = _setup()
    snapshot = get_rng_snapshot()
    problems = []
    ref = _reference(full, inputs[0], inputs[1], inputs[2], mask)
    plain0 = _step(None, layers, inputs, mask, snapshot, p=0.0)
    if not torch.allclose(plain0["output"], ref, rtol=1e-5, atol=1e-6):
        problems.append("plain tp run differs from the unsharded reference")
    want = _step(None, layers, inputs, mask, snapshot)
    for mode, kwargs in MODES.items():
        ds.configure(parallel_state, **kwargs)
        runs = ((ds.checkpoint, False), (ds.checkpoint, True), (ds.non_reentrant_checkpoint, False))
        for ckpt, as_kwargs in runs:
            for step in range(2):  # contiguous: the second step reuses the buffers
                got = _step(ckpt, layers, inputs, mask, snapshot, as_kwargs=as_kwargs)
                problems += [
                    f"{mode} ({ckpt.__name__}, kwargs={as_kwargs}, step {step}): {k} differs"
                    for k in want
                    if not torch.equal(want[k], got[k])
                ]
    # bf16 autocast once: the recompute replays the forward's autocast state.
    ds.configure(parallel_state, partition_activations=True, checkpoint_in_cpu=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_bf16 = _step(None, layers, inputs, mask, snapshot)
        got_bf16 = _step(ds.checkpoint, layers, inputs, mask, snapshot)
    problems += [
        f"bf16: {k} differs" for k in want_bf16 if not torch.equal(want_bf16[k], got_bf16[k])
    ]
    ds.configure(parallel_state)
    return problems


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_option_is_bitwise_equal_to_the_plain_run(world_size):
    for rank, problems in enumerate(run_distributed(_body_equivalence, world_size, timeout=240)):
        assert problems == [], f"rank {rank}: {problems}"


# --- memory, buffers, torch.autograd.grad -------------------------------------------------------


def _double(x, y):
    return x * 2 + y


def _sin_mul(x, y):  # saves its inputs for backward: its gradient depends on them
    return torch.sin(x) * y


def _saved_bytes(x, y) -> int:
    with count_saved_activations() as report:
        out = ds.checkpoint(_double, x, y)
    total = report.total_bytes
    out.sum().backward()
    return total


class _OlderMpu:
    """DeepSpeed's older mpu names only (get_model_parallel_*), served by parallel_state."""

    def get_model_parallel_rank(self):
        return parallel_state.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self):
        return parallel_state.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return parallel_state.get_tensor_model_parallel_group()


def _body_memory() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    ds.configure(parallel_state)
    ds.model_parallel_cuda_manual_seed(SEED)
    tp = dist.get_world_size()
    x = torch.randn(SHAPE, requires_grad=True)
    y = torch.randn(3, 1, 1)  # fewer elements than tp=4: padded
    result = {"whole": _saved_bytes(x, y)}
    ds.configure(parallel_state, partition_activations=True)
    result["partitioned"] = _saved_bytes(x, y)
    ds.configure(parallel_state)
    ds.PARTITION_ACTIVATIONS = True  # a global set directly is obeyed
    result["partitioned by global"] = _saved_bytes(x, y)
    ds.configure(_OlderMpu(), partition_activations=True)
    result["partitioned, older mpu"] = _saved_bytes(x, y)
    chunk = -(-x.numel() // tp) * 4 + -(-y.numel() // tp) * 4
    result["expected"] = (x.numel() * 4 + y.numel() * 4, chunk)

    # Contiguous buffers: the same tensors every step, and too many checkpoints is an error.
    ds.configure(parallel_state, partition_activations=True, contiguous_checkpointing=True,
                 num_checkpoints=2)  # fmt: skip
    ptrs, grads = [], []
    for _ in range(3):
        x.grad = None
        h = ds.checkpoint(_double, x, y)
        h = ds.checkpoint(_double, h, y)
        h.sum().backward()
        grads.append(x.grad.clone())
        ptrs.append(sorted(t.data_ptr() for b in ds._BUFFERS.slots.values() for t in b))
    result["buffers reused"] = ptrs[0] == ptrs[1] == ptrs[2] and len(ptrs[0]) == 4
    result["buffered grads equal"] = all(torch.equal(g, grads[0]) for g in grads)
    alive = []  # outputs kept alive: their checkpoints still wait for backward
    try:
        for _ in range(3):
            alive.append(ds.checkpoint(_double, x, y))
        result["overflow"] = "no error"
    except MegatronCoreError as e:
        result["overflow"] = str(e)
    del alive
    ds.reset()
    result["after reset"] = ds._BUFFERS.slots == {}
    ds.checkpoint(_double, x, y).sum().backward()  # works again after reset

    # non_reentrant_checkpoint with torch.autograd.grad, partitioned and offloaded.
    ds.configure(parallel_state, partition_activations=True, checkpoint_in_cpu=True)
    want = torch.autograd.grad(_double(x, y).pow(2).sum(), x)[0]
    got = torch.autograd.grad(ds.non_reentrant_checkpoint(_double, x, y).pow(2).sum(), x)[0]
    result["autograd.grad equal"] = torch.equal(want, got)

    # non_reentrant_checkpoint with contiguous buffers: the same buffers every step, gradients
    # as without checkpointing, and a retain_graph backward run again after another forward
    # took a buffer still reads its own inputs (a graph's buffers go back when it is freed).
    ds.configure(parallel_state, partition_activations=True, contiguous_checkpointing=True,
                 num_checkpoints=2)  # fmt: skip
    want = torch.autograd.grad(_sin_mul(_sin_mul(x, y), y).sum(), x)[0]
    ptrs, same = [], []
    for _ in range(3):
        x.grad = None
        h = ds.non_reentrant_checkpoint(_sin_mul, x, y)
        ds.non_reentrant_checkpoint(_sin_mul, h, y).sum().backward()
        del h
        same.append(torch.equal(x.grad, want))
        ptrs.append(sorted(t.data_ptr() for b in ds._BUFFERS.slots.values() for t in b))
    result["non-reentrant buffers reused"] = ptrs[0] == ptrs[1] == ptrs[2] and len(ptrs[0]) == 4
    result["non-reentrant grads equal"] = all(same)
    kept = ds.non_reentrant_checkpoint(_sin_mul, x, y)
    first = torch.autograd.grad(kept.sum(), x, retain_graph=True)[0]
    other = ds.non_reentrant_checkpoint(_sin_mul, x * 3.0, y)  # takes the other buffers
    torch.autograd.grad(other.sum(), x)
    again = torch.autograd.grad(kept.sum(), x)[0]
    result["retain_graph backward again"] = torch.equal(first, again) and torch.equal(
        first, torch.autograd.grad(_sin_mul(x, y).sum(), x)[0]
    )
    del kept, other
    ds.reset()

    # model_parallel_reconfigure_tp_seed: the model-parallel stream restarts at seed + 2718 + rank.
    ds.configure(parallel_state)
    ds.model_parallel_reconfigure_tp_seed(5)
    dev = device.current_device()  # the tracker's streams live on the device
    with ds.get_cuda_rng_tracker().fork():
        got = torch.rand(3, device=dev)
    stream = torch.Generator(device=dev).manual_seed(5 + 2718 + dist.get_rank())
    want = torch.rand(3, generator=stream, device=dev)
    result["reconfigured stream"] = torch.equal(got, want)
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_buffers_and_autograd_grad(world_size):
    for rank, r in enumerate(run_distributed(_body_memory, world_size, timeout=240)):
        whole, chunk = r["expected"]
        assert r["whole"] == whole, rank
        assert r["partitioned"] == chunk, rank  # 1/tp of every floating argument, padded
        assert r["partitioned by global"] == chunk, rank
        assert r["partitioned, older mpu"] == chunk, rank
        assert r["reconfigured stream"], rank
        assert r["buffers reused"] and r["buffered grads equal"], rank
        assert r["non-reentrant buffers reused"] and r["non-reentrant grads equal"], rank
        assert r["retain_graph backward again"], rank
        assert "more than num_checkpoints (2)" in r["overflow"], r["overflow"]
        assert r["after reset"] and r["autograd.grad equal"], rank


# --- in-process: configuration, errors, profile lines -------------------------------------------


@pytest.fixture
def restore_globals():
    saved = {name: getattr(ds, name) for name in GLOBALS}
    yield
    for name, value in saved.items():
        setattr(ds, name, value)
    ds.reset()


def test_config_dict_file_and_overrides(restore_globals, tmp_path):
    section = {"partition_activations": True, "cpu_checkpointing": True,
               "contiguous_memory_optimization": True, "number_checkpoints": 4,
               "synchronize_checkpoint_boundary": True, "profile": True}  # fmt: skip
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    for config in ({"activation_checkpointing": section}, str(path), path):
        ds.configure(None, deepspeed_config=config)
        assert ds.is_configured() and ds.num_layers == 4
        assert ds.PARTITION_ACTIVATIONS and ds.CPU_CHECKPOINT and ds.CONTIGUOUS_CHECKPOINTING
        assert ds.SYNCHRONIZE and ds.PROFILE_TIME
    ds.configure(None, deepspeed_config=str(path), profile=False, num_checkpoints=2)
    assert ds.PROFILE_TIME is False and ds.num_layers == 2 and ds.CPU_CHECKPOINT
    ds.configure(None, deepspeed_config={"train_batch_size": 8})  # DeepSpeed's defaults
    assert not (ds.PARTITION_ACTIVATIONS or ds.CPU_CHECKPOINT or ds.CONTIGUOUS_CHECKPOINTING)
    assert ds.num_layers is None
    ds.set_num_layers(5)
    assert ds.num_layers == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"deepspeed_config": {"activation_checkpointing": {"partition": True}}}, "'partition'"),
        ({"deepspeed_config": {"activation_checkpointing": []}}, r"\[\]"),
        ({"deepspeed_config": 3}, "int"),
        ({"deepspeed_config": "/nonexistent/ds.json"}, "/nonexistent/ds.json"),
        ({"partition_activations": "yes"}, "'yes'"),
        ({"num_checkpoints": 0}, r"num_checkpoints \(0\)"),
        ({"num_checkpoints": 2.0}, r"num_checkpoints \(2.0\)"),
        ({"partition_activations": True, "contiguous_checkpointing": True}, "num_checkpoints"),
        ({"contiguous_checkpointing": True, "num_checkpoints": 2}, "partition_activations"),
    ],
)
def test_bad_configuration_is_refused_and_changes_nothing(restore_globals, kwargs, match):
    ds.configure(None, profile=True)
    with pytest.raises(MegatronCoreError, match=match):
        ds.configure(None, **kwargs)
    assert ds.PROFILE_TIME is True  # nothing was changed


def test_bad_mpu_and_num_layers(restore_globals):
    with pytest.raises(MegatronCoreError, match="object"):
        ds.configure(object())
    with pytest.raises(MegatronCoreError, match=r"nlayers \(-1\)"):
        ds.set_num_layers(-1)
    ds.configure(None, partition_activations=True)
    ds.CONTIGUOUS_CHECKPOINTING = True  # set directly, without num_layers
    with pytest.raises(MegatronCoreError, match="num_layers is None"):
        ds.checkpoint(_double, torch.ones(2, requires_grad=True), torch.ones(2))


def test_profile_lines_and_reentrant_autograd_grad(restore_globals, capsys):
    ds.configure(None, profile=True)
    x = torch.randn(4, requires_grad=True)
    ds.checkpoint(_double, x, torch.ones(4)).sum().backward()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("time (ms) | fwd: ")
    assert lines[1].startswith("time (ms) | backward: ")
    with pytest.raises(MegatronCoreError, match="autograd.grad"):
        torch.autograd.grad(ds.checkpoint(_double, x, torch.ones(4)).sum(), x)
    capsys.readouterr()
    ds.non_reentrant_checkpoint(_sin_mul, x, torch.ones(4)).sum().backward()
    lines = capsys.readouterr().out.splitlines()  # the forward, then the recompute in backward
    assert [line.split(":")[0] for line in lines] == ["time (ms) | fwd", "time (ms) | backward"]


# --- against DeepSpeed's own checkpoint (only where deepspeed is installed) -----------------------


def _deepspeed_module():
    try:
        from deepspeed.runtime.activation_checkpointing import checkpointing
    except Exception:  # not installed, or it fails to import on this torch
        return None
    return checkpointing


class _PlainLayer(nn.Module):
    """Column- then row-parallel linear, dropout on the default generator (DeepSpeed replays
    only its own tracker, so no tracker fork here)."""

    def __init__(self, full):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        start = parallel_state.get_tensor_model_parallel_rank() * (FFN // tp)
        w1, _, w2, _ = full
        self.w1 = nn.Parameter(w1[start : start + FFN // tp].clone())
        self.w2 = nn.Parameter(w2[:, start : start + FFN // tp].clone())

    def forward(self, x, scale):
        h = F.gelu(F.linear(copy_to_tensor_model_parallel_region(x), self.w1))
        return F.dropout(reduce_from_tensor_model_parallel_region(F.linear(h, self.w2)) * scale, P)


def _body_against_deepspeed() -> list[str]:
    import deepspeed

    theirs = _deepspeed_module()
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the harness's process group
    full, _, _, _ = _setup()
    layers = nn.ModuleList([_PlainLayer(w) for w in full])
    x0 = torch.randn(4, 2, HIDDEN)  # numel divisible by tp = 1, 2 (DeepSpeed asserts it)
    problems = []
    # Not {"checkpoint_in_cpu": True} alone: on a CPU device DeepSpeed 0.19.8's copy of the
    # arguments (.to("cpu")) is the argument itself, which it then empties (arg.data =
    # torch.empty([])), so its recompute gets 0-d inputs; partitioned, the copy is a clone.
    for kwargs in ({}, {"partition_activations": True},
                   {"partition_activations": True, "checkpoint_in_cpu": True}):  # fmt: skip
        if kwargs.get("partition_activations") and dist.get_world_size() == 1:
            # DeepSpeed 0.19.8 at mp_size 1 leaves a partitioned argument's .data flat (1-D)
            # after backward, so accumulating its leaf's gradient fails: nothing to compare.
            continue
        results = []
        for module in (ds, theirs):
            module.configure(parallel_state, **kwargs)
            torch.manual_seed(7)
            layers.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            # One scale per layer: DeepSpeed empties an argument's .data until its backward, so
            # a tensor passed to two of its checkpoints breaks there (ours leaves it alone).
            scales = [torch.tensor([1.5], requires_grad=True) for _ in layers]
            h = x
            for layer, scale in zip(layers, scales):
                h = module.checkpoint(layer, h, scale)
            h.pow(2).sum().backward()
            grads = [x.grad] + [s.grad for s in scales] + [p.grad for p in layers.parameters()]
            results.append([h.detach()] + grads)
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            problems.append(f"{kwargs}: ours and DeepSpeed's differ")
    ds.configure(parallel_state)
    return problems


@pytest.mark.skipif(
    _deepspeed_module() is None,
    reason=(
        "deepspeed is not installed (a benchmark/test-only dependency: "
        "docs/benchmarks/deepspeed.md)"
    ),
)
@pytest.mark.parametrize("world_size", [1, 2])
def test_bitwise_equal_to_deepspeed_itself(world_size):
    for rank, problems in enumerate(run_distributed(_body_against_deepspeed, world_size)):
        assert problems == [], f"rank {rank}: {problems}"


def test_partition_switch_and_detach_variable(restore_globals, caplog):
    # DeepSpeed 0.19.8's public names beyond configure/checkpoint: the partition switch and
    # detach_variable (its other public functions are helpers of its own implementation).
    with caplog.at_level(logging.INFO, logger="megatron_core.deepspeed_checkpointing"):
        ds.partition_activations_in_checkpoint(True)
    assert ds.PARTITION_ACTIVATIONS is True and "partition activations" in caplog.text
    ds.partition_activations_in_checkpoint(False)
    assert ds.PARTITION_ACTIVATIONS is False
    with pytest.raises(MegatronCoreError, match="partition_activation \\(1\\) must be a bool"):
        ds.partition_activations_in_checkpoint(1)
    x = torch.ones(2, requires_grad=True) * 2.0
    ids = torch.arange(3)
    out = ds.detach_variable((x, ids, "text"))
    assert out[0].is_leaf and out[0].requires_grad and torch.equal(out[0], x)
    assert out[1] is not ids and torch.equal(out[1], ids) and not out[1].requires_grad
    assert out[2] == "text"
    assert ds.detach_variable((x,), device="cpu")[0].device.type == "cpu"
    with pytest.raises(MegatronCoreError, match="inputs must be a tuple, got list"):
        ds.detach_variable([x])
