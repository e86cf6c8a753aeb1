"""checkpoint and its variants: bitwise equality with the plain stack, memory kept, errors.

Multi-rank bodies run with tp = world size (1, 2, 4). Comparisons are torch.equal (bitwise): on
the CPU the recompute runs the same kernels on the same values with the same RNG states, so any
difference, even in the last bit, is a bug (wrong dropout mask, wrong gather, lost padding).
"""

import re
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_core import consistency, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import (
    CheckpointWithoutOutput,
    capture_saved_inputs,
    checkpoint,
    checkpoint_layer_stack,
    checkpoint_sequential,
    copy_to_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    get_rng_snapshot,
    model_parallel_cuda_manual_seed,
    reduce_from_tensor_model_parallel_region,
    set_checkpoint_early_stop,
    set_rng_snapshot,
)
from megatron_core.testing import run_distributed

SEED = 1234
SHAPE = (3, 7, 5)  # 105 elements: neither tp=2 nor tp=4 divides it (padded chunks)
P = 0.3  # dropout probability
WORLD_SIZES = [1, 2, 4]


HIDDEN, FFN = 5, 8  # FFN splits over tp = 1, 2, 4


class _Layer(nn.Module):
    """A tensor-parallel MLP block, as in megatron-core: f (copy) -> column-parallel linear ->
    dropout on the split activation inside the tracker fork -> gelu -> row-parallel linear -> g
    (all-reduce) -> + extra, * scale, masked -> dropout on the replicated output outside any fork.

    Input and output are equal on every TP rank, as between megatron-core's layers; that is what
    makes distributing the saved input possible (NOTE [ Checkpoint rules ], rule 3).
    """

    def __init__(self):
        super().__init__()
        shard = FFN // parallel_state.get_tensor_model_parallel_world_size()
        start = parallel_state.get_tensor_model_parallel_rank() * shard
        rows = slice(start, start + shard)
        w1, b1 = torch.randn(FFN, HIDDEN) / 2, torch.randn(FFN)
        w2, b2 = torch.randn(HIDDEN, FFN) / 2, torch.randn(HIDDEN)
        self.w1, self.b1 = nn.Parameter(w1[rows].clone()), nn.Parameter(b1[rows].clone())
        self.w2, self.b2 = nn.Parameter(w2[:, rows].clone()), nn.Parameter(b2)

    def forward(self, x, extra, scale, mask, p):
        h = F.linear(copy_to_tensor_model_parallel_region(x), self.w1, self.b1)
        with get_cuda_rng_tracker().fork():
            h = F.dropout(h, p)
        h = reduce_from_tensor_model_parallel_region(F.linear(F.gelu(h), self.w2)) + self.b2
        h = ((h + extra) * scale).masked_fill(mask, 0.0)
        return F.dropout(h, p)


def _setup():
    """parallel_state with tp = world size, seeded streams, 3 layers, inputs (same on all ranks)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model_parallel_cuda_manual_seed(SEED)
    layers = nn.ModuleList([_Layer() for _ in range(3)])
    inputs = (torch.randn(SHAPE), torch.randn(SHAPE[1:]), torch.tensor([1.5]))
    mask = torch.rand(SHAPE[1:]) > 0.8
    return layers, inputs, mask


# --- the ways to run the stack ----------------------------------------------------------------


def _plain(layers, x, extra, scale, mask):
    for layer in layers:
        x = layer(x, extra, scale, mask, P)
    return x


def _each(split, **kw):
    """Every layer its own checkpoint, positional inputs (megatron-core's call)."""

    def run(layers, x, extra, scale, mask):
        for layer in layers:
            x = checkpoint(layer, split, x, extra, scale, mask, P, **kw)
        return x

    return run


def _call_structured(x, tensors, *, layer, mask, p):
    return layer(x, tensors["extra"], tensors["scale"][0], mask, p)


def _structured(split, **kw):
    """Non-reentrant: tensors inside a dict and a list, and keyword arguments."""

    def run(layers, x, extra, scale, mask):
        for layer in layers:
            tensors = {"extra": extra, "scale": [scale]}
            x = checkpoint(
                _call_structured, split, x, tensors, layer=layer, mask=mask, p=P,
                use_reentrant=False, **kw,
            )  # fmt: skip
        return x

    return run


def _nested(inner_reentrant):
    """A distributed non-reentrant checkpoint around the whole stack, one per layer inside."""

    def outer(x, extra, scale, mask, layers):
        for layer in layers:
            x = checkpoint(layer, True, x, extra, scale, mask, P, use_reentrant=inner_reentrant)
        return x

    def run(layers, x, extra, scale, mask):
        return checkpoint(outer, True, x, extra, scale, mask, layers, use_reentrant=False)

    return run


def _stack(method, n, **kw):
    def run(layers, x, extra, scale, mask):
        return checkpoint_layer_stack(
            layers, x, extra, scale, mask, P, recompute_method=method, recompute_num_layers=n,
            distribute_saved_activations=True, **kw,
        )  # fmt: skip

    return run


def _sequential(segments, split, **kw):
    """checkpoint_sequential over the layers (torch's API), extra inputs closed over."""

    def run(layers, x, extra, scale, mask):
        fns = [lambda h, layer=layer: layer(h, extra, scale, mask, P) for layer in layers]
        return checkpoint_sequential(
            fns, segments, x, use_reentrant=False, distribute_saved_activations=split, **kw
        )

    return run


MODES = {
    "reentrant": _each(False),
    "reentrant, distributed": _each(True),
    "reentrant, distributed all": _each(True, distribute="all"),
    "reentrant, offloaded": _each(False, offload_to_cpu=True),
    "reentrant, offloaded + distributed all": _each(True, offload_to_cpu=True, distribute="all"),
    "reentrant, checked": _each(True, check_determinism=True),
    "non-reentrant": _each(False, use_reentrant=False),
    "non-reentrant, distributed": _each(True, use_reentrant=False),
    "non-reentrant, offloaded": _each(False, use_reentrant=False, offload_to_cpu=True),
    "non-reentrant, structured, distributed all": _structured(True, distribute="all"),
    "non-reentrant, structured, offloaded + distributed all, checked": _structured(
        True, distribute="all", offload_to_cpu=True, check_determinism=True
    ),
    "non-reentrant, distributed, no early stop": _each(True, use_reentrant=False, early_stop=False),
    "non-reentrant, distributed, debug": _each(True, use_reentrant=False, debug=True),
    "nested non-reentrant in non-reentrant": _nested(inner_reentrant=False),
    "nested reentrant in non-reentrant": _nested(inner_reentrant=True),
    # A reentrant region of several layers sums the gradients of an input shared by its layers
    # (extra, scale) inside its own backward, (g2 + g1) + g3 instead of (g3 + g2) + g1: equal to
    # rounding only, so the reentrant uniform stack is compared in test_layer_stack_methods.
    "layer stack, uniform 2, non-reentrant": _stack("uniform", 2, use_reentrant=False),
    "layer stack, block 2": _stack("block", 2),
    "checkpoint_sequential 2, distributed": _sequential(2, True),
    "checkpoint_sequential 3, offloaded + distributed all": _sequential(
        3, True, offload_to_cpu=True, distribute="all"
    ),
}


def _step(run, layers, inputs, mask, snapshot):
    """Forward + two backward passes (retain_graph) from ``snapshot``: what to compare."""
    set_rng_snapshot(snapshot)
    layers.zero_grad(set_to_none=True)
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = run(layers, *leaves, mask)
    loss = (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()
    loss.backward(retain_graph=True)
    named = [("x", leaves[0]), ("extra", leaves[1]), ("scale", leaves[2])]
    named += list(layers.named_parameters())
    first = {f"grad of {name}": t.grad.clone() for name, t in named}
    layers.zero_grad(set_to_none=True)
    for _, t in named[:3]:
        t.grad = None
    loss.backward()
    second = {f"grad of {name}": t.grad for name, t in named}
    draws = {"draw after backward": torch.rand(4)}
    with get_cuda_rng_tracker().fork():
        draws["tracker draw after backward"] = torch.rand(4)
    return {"output": out.detach(), **first, **draws}, second


def _body_equivalence() -> list[str]:
    layers, inputs, mask = _setup()
    snapshot = get_rng_snapshot()
    want, _ = _step(_plain, layers, inputs, mask, snapshot)
    problems = []
    for mode, run in {"plain": _plain, **MODES}.items():
        got, second = _step(run, layers, inputs, mask, snapshot)
        problems += [f"{mode}: {k} differs" for k in want if not torch.equal(want[k], got[k])]
        problems += [
            f"{mode}: second backward (retain_graph=True) differs in {k}"
            for k in second
            if not torch.equal(second[k], got[k])
        ]
    return problems


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_mode_is_bitwise_equal_to_the_plain_stack(world_size):
    for rank, problems in enumerate(run_distributed(_body_equivalence, world_size, timeout=240)):
        assert problems == [], f"rank {rank}: {problems}"


# --- what is kept between forward and backward; torch.autograd.grad ---------------------------


def _storage_refs(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _body_saved_inputs() -> list[str]:
    """Bytes each checkpoint keeps of its input, and whether the caller's storage stays alive."""
    layers, (x0, extra, scale), mask = _setup()
    tp = dist.get_world_size()
    full, chunk = x0.numel() * 4, -(-x0.numel() // tp) * 4  # float32: 4 bytes per element
    nr = {"use_reentrant": False}
    # name -> (distribute, checkpoint kwargs, bytes kept, caller's storage kept alive)
    cases = {
        "reentrant": (False, {}, full, True),  # the control: the whole input is kept
        # over one rank nothing is split: the input is kept as given (rule 3), not copied
        "reentrant, distributed": (True, {}, chunk, tp == 1),
        "reentrant, offloaded": (False, {"offload_to_cpu": True}, full, False),
        "reentrant, offloaded + distributed": (True, {"offload_to_cpu": True}, chunk, False),
        "non-reentrant": (False, nr, full, True),
        "non-reentrant, distributed": (True, nr, chunk, tp == 1),
        "non-reentrant, offloaded + distributed": (
            True,
            {**nr, "offload_to_cpu": True},
            chunk,
            False,
        ),
    }
    problems = []
    for name, (split, kw, want_bytes, want_alive) in cases.items():
        base = x0.clone().requires_grad_()
        h = base * 1.0  # not a leaf: only the checkpoint can keep its storage alive
        before, storage = h.detach().clone(), h.untyped_storage()
        with capture_saved_inputs() as saved:
            out = checkpoint(lambda t: layers[0](t, extra, scale, mask, P), split, h, **kw)
        if h.shape != SHAPE or not torch.equal(h, before) or storage.nbytes() != full:
            problems.append(f"{name}: the caller's tensor was modified")
        if saved[0].nbytes() != want_bytes:
            problems.append(f"{name}: keeps {saved[0].nbytes()} bytes, not {want_bytes}")
        if kw.get("use_reentrant", True):  # what the autograd node itself holds
            node = sum(t.untyped_storage().nbytes() for t in out.grad_fn.saved_tensors)
            if node != want_bytes:
                problems.append(f"{name}: the autograd node holds {node} bytes")
        del h
        if (_storage_refs(storage) > 1) != bool(want_alive):
            problems.append(f"{name}: caller's storage alive is {not want_alive}")
        out.sum().backward()
        if base.grad is None or base.grad.shape != SHAPE:
            problems.append(f"{name}: no gradient for the input")
    # distribute="all": every floating-point input of >= tp elements is split; the mask is not.
    with capture_saved_inputs() as saved:
        checkpoint(layers[0], True, x0, extra, scale, mask, P, distribute="all", **nr)
    want = chunk + -(-extra.numel() // tp) * 4 + 4 + mask.numel()  # scale: 1 element, 4 bytes
    if saved[0].nbytes() != want:
        problems.append(f"distribute='all' keeps {saved[0].nbytes()} bytes, not {want}")
    return problems + _autograd_grad_problems(layers, (x0, extra, scale), mask)


def _autograd_grad_problems(layers, inputs, mask) -> list[str]:
    """Reentrant refuses torch.autograd.grad; non-reentrant (distributed) matches .backward()."""
    snapshot = get_rng_snapshot()

    def forward(run):
        set_rng_snapshot(snapshot)
        layers.zero_grad(set_to_none=True)
        leaves = [t.clone().requires_grad_() for t in inputs]
        return run(layers, *leaves, mask), [*leaves, *layers.parameters()]

    out, wrt = forward(_plain)
    out.sum().backward()
    want = [t.grad for t in wrt]
    problems = []
    for mode in ("non-reentrant, distributed", "non-reentrant, structured, distributed all"):
        out, wrt = forward(MODES[mode])
        got = torch.autograd.grad(out.sum(), wrt)
        if not all(torch.equal(a, b) for a, b in zip(want, got)):
            problems.append(f"{mode}: torch.autograd.grad differs from .backward()")
        if any(t.grad is not None for t in wrt):
            problems.append(f"{mode}: torch.autograd.grad accumulated into .grad")
    out, wrt = forward(MODES["reentrant, distributed"])
    try:
        torch.autograd.grad(out.sum(), wrt[:1])
        problems.append("reentrant: torch.autograd.grad was accepted")
    except MegatronCoreError as e:
        if "does not support torch.autograd.grad" not in str(e):
            problems.append(f"reentrant: unclear error {e}")
    return problems + _unequal_input_problems(layers, inputs, mask)


def _unequal_input_problems(layers, inputs, mask) -> list[str]:
    """A distributed input that differs across the TP group: forward refuses it in the default
    mode and check mode; with the checks off, check_determinism refuses it."""
    if dist.get_world_size() == 1:
        return []
    for mode in ("window", "always"):
        with consistency.check_mode(mode):
            x = (inputs[0] + dist.get_rank()).requires_grad_()
            try:
                checkpoint(layers[0], True, x, *inputs[1:], mask, P)
                return [f"{mode}: forward distributed an input that differs across TP ranks"]
            except consistency.RankDisagreementError as e:
                named = "checkpoint(distribute_saved_activations=True) input #0" in str(e)
                if not (named and "content checksum" in str(e)):
                    return [f"{mode}: unclear error for an unequal distributed input: {e}"]
    with consistency.check_mode(False):
        return _unequal_input_determinism_problems(layers, inputs, mask)


def _unequal_input_determinism_problems(layers, inputs, mask) -> list[str]:
    """With the checks off, check_determinism refuses the differing input in backward."""
    x = (inputs[0] + dist.get_rank()).requires_grad_()
    out = checkpoint(layers[0], True, x, *inputs[1:], mask, P, check_determinism=True)
    try:
        out.sum().backward()
        return ["an input that differs across TP ranks was distributed without an error"]
    except MegatronCoreError as e:
        ok = "must be the same on every rank of the TP group" in str(e)
        if not ok:
            return [f"unclear error for an unequal distributed input: {e}"]
    # Only the last rank's input differs, and only inside its own chunk: the gathered tensor is
    # then exactly that rank's input. Every rank must still raise (none may go on into backward's
    # collectives while the others stop).
    x = inputs[0].clone()
    if dist.get_rank() == dist.get_world_size() - 1:
        x.view(-1)[-1] += 1.0
    out = checkpoint(
        layers[0], True, x.requires_grad_(), *inputs[1:], mask, P, check_determinism=True
    )
    try:
        out.sum().backward()
        return ["a rank whose own input matched the gathered one went on into backward"]
    except MegatronCoreError as e:
        ok = "must be the same on every rank of the TP group" in str(e)
        if dist.get_rank() == dist.get_world_size() - 1:  # the case this part is about
            ok = ok and "it matches here, but not on another rank" in str(e)
        return [] if ok else [f"unclear error for an unequal distributed input: {e}"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_saved_inputs_memory_and_autograd_grad(world_size):
    for rank, problems in enumerate(run_distributed(_body_saved_inputs, world_size, timeout=240)):
        assert problems == [], f"rank {rank}: {problems}"


# --- single process: determinism check, errors, CheckpointWithoutOutput, layer stacks ---------


@pytest.fixture
def seeded():
    """Seeded RNG streams without parallel_state (tp rank 0); the tracker is emptied after."""
    model_parallel_cuda_manual_seed(SEED, tp_rank=0)
    yield get_rng_snapshot()
    get_cuda_rng_tracker().reset()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_determinism_check_catches_an_unreplayed_generator(seeded, use_reentrant):
    private = torch.Generator().manual_seed(7)  # not in the RNG snapshot: recompute differs

    def noisy(x):
        return x * (torch.rand(x.shape, generator=private) > 0.5)

    x = torch.randn(4, 6, requires_grad=True)
    out = checkpoint(noisy, False, x, use_reentrant=use_reentrant, check_determinism=True)
    first = "output #0" if use_reentrant else "saved tensor #0"
    with pytest.raises(MegatronCoreError, match=rf"{first} \(.*\): values differ"):
        out.sum().backward()
    # Off by default: the same function then gives a silently wrong gradient.
    x.grad = None
    out = checkpoint(noisy, False, x, use_reentrant=use_reentrant)
    out.sum().backward()
    assert not torch.equal(x.grad, (out != 0).to(x.dtype))


def test_bad_input_is_refused_before_anything_runs(seeded):
    x = torch.randn(4, requires_grad=True)
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(MegatronCoreError, match="needs the tensor-parallel group, but"):
        checkpoint(torch.sin, True, x)
    with pytest.raises(MegatronCoreError, match=r"splits args\[0\], which must be a tensor"):
        checkpoint(lambda s, t: t * s, True, 2.0, x)
    with pytest.raises(MegatronCoreError, match=r"distribute_saved_activations \(a Tensor\)"):
        checkpoint(torch.sin, x)  # forgot megatron-core's second argument
    with pytest.raises(MegatronCoreError, match=r"distribute \('some'\) must be one of"):
        checkpoint(torch.sin, False, x, distribute="some")
    with pytest.raises(MegatronCoreError, match="need use_reentrant=False"):
        checkpoint(torch.sin, False, x, alpha=2)
    with pytest.raises(MegatronCoreError, match=r"recompute_method \('full'\) must be one of"):
        checkpoint_layer_stack([torch.sin], x, recompute_method="full", recompute_num_layers=1)
    with pytest.raises(MegatronCoreError, match=r"recompute_num_layers \(0\) must be an integer"):
        checkpoint_layer_stack([torch.sin], x, recompute_method="uniform", recompute_num_layers=0)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_input_changed_in_place_before_backward_is_refused(seeded, use_reentrant):
    h = torch.randn(4, requires_grad=True) * 1.0
    out = checkpoint(torch.sin, False, h, use_reentrant=use_reentrant)
    h.add_(1.0)
    # reentrant: autograd's own saved-tensor check; non-reentrant: the checkpoint's (rule 1),
    # whose message names the fix.
    fix = "modified by an inplace operation" if use_reentrant else "modified in place.*Pass a clone"
    with pytest.raises(RuntimeError, match=fix):
        out.sum().backward()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_parameter_or_input_returned_as_is_stays_itself(seeded, use_reentrant):
    # megatron-core's MLP returns (output, fc2 bias) when the bias is added later: the bias is
    # a parameter the region returns unchanged. Through a reentrant Function it would become
    # the Function's output (no longer a leaf, no .grad; its backward re-entered without end);
    # here it keeps its identity as a leaf and gets the gradient of its use outside, as without
    # checkpoint. An input returned as is gets its gradient too.
    lin = nn.Linear(4, 4)
    bias = nn.Parameter(torch.randn(4))
    x = torch.randn(2, 4, requires_grad=True)

    def region(h, extra):
        return lin(h), bias, extra

    def loss(outputs):
        out, b, extra = outputs
        return ((out + b) ** 2).sum() + (extra * b).sum()

    extra = torch.randn(4, requires_grad=True)
    loss(region(x, extra)).backward()
    wanted = [t.grad.clone() for t in (x, extra, bias, lin.weight)]
    for t in (x, extra, bias, lin.weight):
        t.grad = None
    outputs = checkpoint(region, False, x, extra, use_reentrant=use_reentrant)
    assert bias.is_leaf and bias.grad_fn is None
    loss(outputs).backward()
    assert bias.is_leaf
    for got, want in zip((x.grad, extra.grad, bias.grad, lin.weight.grad), wanted):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_misuse_raises_or_warns_as_torch_does(seeded):
    # Reentrant, no input requires grad: torch warns (the parameters get no gradient).
    lin = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True.*"
                      "use_reentrant=False"):  # fmt: skip
        out = checkpoint(lin, False, torch.randn(2, 4))
    assert not out.requires_grad
    # ... the non-reentrant mode has no such gap: the parameters get their gradient.
    checkpoint(lin, False, torch.randn(2, 4), use_reentrant=False).sum().backward()
    assert lin.weight.grad is not None
    # Reentrant, the recomputed outputs need no grad: torch raises; so do we, naming the fix.
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: t.detach() * 2 if torch.is_grad_enabled() else t * 2, False, x)
    with pytest.raises(MegatronCoreError, match="none of the recomputed outputs requires grad.*"
                       "call the function without checkpoint"):  # fmt: skip
        out.sum().backward()
    # Reentrant + torch.autograd.grad: refused, the message names use_reentrant=False.
    out = checkpoint(torch.sin, False, x)
    with pytest.raises(MegatronCoreError, match=r"call \.backward\(\), or use checkpoint\(\.\.\., "
                       "use_reentrant=False"):  # fmt: skip
        torch.autograd.grad(out.sum(), x)
    # Options of the non-reentrant mode are refused by the reentrant one, before anything runs.
    with pytest.raises(MegatronCoreError, match="context_fn and debug=True need use_reentrant"):
        checkpoint(torch.sin, False, x, debug=True)


def _act(h):
    with get_cuda_rng_tracker().fork():
        h = F.dropout(h, P)
    return F.gelu(h)


@pytest.mark.parametrize("discard", [True, False])
def test_checkpoint_without_output_is_bitwise_equal_and_releases_the_output(seeded, discard):
    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    x0 = torch.randn(SHAPE)

    def step(use_checkpoint):
        set_rng_snapshot(seeded)
        fc1.zero_grad(set_to_none=True), fc2.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        ckpt = CheckpointWithoutOutput() if use_checkpoint else None
        act = ckpt.checkpoint(_act, fc1(x)) if ckpt else _act(fc1(x))
        out = fc2(act)
        if ckpt and discard:
            ckpt.discard_output_and_register_recompute(out)
            assert act.untyped_storage().nbytes() == 0  # released until backward
        out = F.dropout(out, P)
        out.sum().backward()
        grads = [x.grad, *[p.grad for p in (*fc1.parameters(), *fc2.parameters())]]
        return [out.detach(), act.detach().clone(), *grads, torch.rand(3)]

    want, got = step(False), step(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("method, regions", [("uniform", 3), ("block", 2)])
def test_layer_stack_methods(seeded, method, regions):
    layers = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Dropout(P)) for _ in range(5)]
    x0, bias = torch.randn(SHAPE), torch.randn(HIDDEN)

    def step(use_checkpoint):
        set_rng_snapshot(seeded)
        x, b = x0.clone().requires_grad_(), bias.clone().requires_grad_()
        fns = [lambda h, b, layer=layer: layer(h) + b for layer in layers]
        with capture_saved_inputs() as saved:
            if use_checkpoint:
                out = checkpoint_layer_stack(
                    fns, x, b, recompute_method=method, recompute_num_layers=2
                )
            else:
                out = fns[4](fns[3](fns[2](fns[1](fns[0](x, b), b), b), b), b)
        params = [p for layer in layers for p in layer.parameters()]
        grads = torch.autograd.grad(out.sum(), [x, b, *params]) if not use_checkpoint else None
        if use_checkpoint:
            out.sum().backward()
            grads = [x.grad, b.grad, *[p.grad for p in params]]
            for p in params:
                p.grad = None
        return out, grads, len(saved)

    (want, want_grads, _), (got, got_grads, made) = step(False), step(True)
    assert made == regions  # uniform 2 of 5: [0,2) [2,4) [4,5); block 2: layers 0 and 1
    assert torch.equal(want, got)
    # A region of several layers sums the gradient of the shared input b in its own backward,
    # in another order than the plain graph: equal up to float32 rounding of a 5-term sum.
    for a, b in zip(want_grads, got_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# early_stop is an option of the non-reentrant mode only.
@pytest.mark.parametrize("use_reentrant, early_stop", [(True, None), (False, True), (False, False)])
def test_autocast_state_of_the_forward_is_replayed(seeded, use_reentrant, early_stop):
    fc = nn.Linear(HIDDEN, HIDDEN)
    x0 = torch.randn(SHAPE)

    def step(use_checkpoint):
        set_rng_snapshot(seeded)
        fc.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn = lambda t: F.dropout(fc(t), P)  # noqa: E731
            kw = {} if use_reentrant else {"early_stop": early_stop}
            out = (
                checkpoint(fn, False, x, use_reentrant=use_reentrant, **kw)
                if use_checkpoint
                else fn(x)
            )
        out.float().sum().backward()  # backward (and the recompute) outside autocast
        return [out, x.grad, fc.weight.grad, fc.bias.grad]

    want, got = step(False), step(True)
    assert got[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(want, got))


class _Scale(torch.overrides.TorchFunctionMode):
    """Doubles every ``torch.nn.functional.linear`` output while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


@pytest.mark.parametrize("use_reentrant, early_stop", [(True, None), (False, True), (False, False)])
def test_torch_function_modes_of_the_forward_are_active_in_the_recompute(
    use_reentrant, early_stop
):
    # A mode active in forward (the switch's CPU mode is one) changes what the region computes;
    # the recompute, run in backward after the mode was left (or where torch ran backward without
    # it), must compute the same thing: the output's graph and the recomputed one agree only if
    # the mode is active again. The mode stack is as it was after backward.
    fc = nn.Linear(HIDDEN, HIDDEN)
    x0 = torch.randn(SHAPE)

    def step(use_checkpoint):
        fc.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with _Scale():
            fn = lambda t: torch.tanh(F.linear(t, fc.weight, fc.bias))  # noqa: E731
            kw = {} if use_reentrant else {"early_stop": early_stop}
            out = (
                checkpoint(fn, False, x, use_reentrant=use_reentrant, **kw)
                if use_checkpoint
                else fn(x)
            )
        out.sum().backward()  # backward (and the recompute) outside the mode
        assert torch.overrides._get_current_function_mode_stack() == []
        return [out, x.grad, fc.weight.grad, fc.bias.grad]

    want, got = step(False), step(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with torch.no_grad():  # the mode did change the computation
        assert not torch.equal(want[0], torch.tanh(fc(x0)))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_taken_inside_a_fork_replays_the_same_masks(seeded, use_reentrant):
    # megatron-core's TransformerBlock runs the whole checkpointed stack inside one fork. The
    # recompute happens in backward, outside any fork; a fork nested in the region must still
    # continue the outer stream's in-flight state (NOTE [ RNG streams ], rules 4 and 5).
    lin = nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)

    def region(inp):
        h = F.dropout(lin(inp), P)
        with get_cuda_rng_tracker().fork():
            h = F.dropout(h, P)
        return F.dropout(h * 2, P)

    def step(use_checkpoint):
        set_rng_snapshot(seeded)
        x.grad, lin.weight.grad = None, None
        with get_cuda_rng_tracker().fork():
            torch.rand(3)  # the stream is in flight when the region starts
            if use_checkpoint:
                out = checkpoint(region, False, x, use_reentrant=use_reentrant)
            else:
                out = region(x)
        out.sum().backward()
        return out, x.grad, lin.weight.grad, torch.rand(4)

    for got, want in zip(step(True), step(False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recomputed_graph_is_freed_after_backward(seeded, use_reentrant):
    # exp saves its own output for backward. A recompute hook that stored that output itself
    # (not a detached alias) made a reference cycle inside autograd's C++ graph that Python's
    # garbage collector cannot see: every backward leaked the recomputed graph.
    import gc
    import weakref

    alive = []

    def region(inp):
        y = inp.exp()
        alive.append(weakref.ref(y))
        return y * y  # saves y after the append: an early-stopped recompute still reaches it

    x = torch.randn(4, 6, requires_grad=True)
    out = checkpoint(region, False, x, use_reentrant=use_reentrant)
    out.sum().backward()
    del out
    gc.collect()
    assert len(alive) == 2  # forward and recompute
    assert [ref() is None for ref in alive] == [True, True]
    torch.testing.assert_close(x.grad, 2 * x.exp() * x.exp(), rtol=0, atol=0)


# --- torch.autograd.grad inside a non-reentrant region --------------------------------------------


def _sin_exp(t):
    return t.sin().exp()


def _grad_region(distribute, nested):
    """A region that differentiates inside itself (a gradient penalty), with dropout in and
    outside the tracker fork; ``nested``: the differentiated part is its own checkpoint."""

    def region(x, w):
        h = F.dropout(x @ w, P)  # default stream: equal on every TP rank, may be distributed
        if nested:
            h = checkpoint(_sin_exp, distribute, h, use_reentrant=False)
        else:
            h = _sin_exp(h)
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        with get_cuda_rng_tracker().fork():
            g = F.dropout(g, P)
        return g * h

    return region


def _body_grad_inside() -> list[str]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model_parallel_cuda_manual_seed(SEED)
    x0, w0 = torch.randn(SHAPE), torch.randn(SHAPE[-1], SHAPE[-1]) / 2
    snapshot = get_rng_snapshot()

    def step(run):
        set_rng_snapshot(snapshot)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = run(x, w)
        out.sum().backward()
        return [out.detach(), x.grad, w.grad, torch.rand(3)]

    problems = []
    for distribute in (False, True):
        for nested in (False, True):
            region = _grad_region(distribute, nested)
            want = step(region)
            got = step(
                lambda x, w, f=region, d=distribute: checkpoint(f, d, x, w, use_reentrant=False)
            )
            if not all(torch.equal(a, b) for a, b in zip(want, got)):
                problems.append(f"distribute={distribute}, nested={nested}: differs from plain")
    return problems


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_autograd_grad_inside_a_region(world_size):
    for rank, problems in enumerate(run_distributed(_body_grad_inside, world_size, timeout=240)):
        assert problems == [], f"rank {rank}: {problems}"


def test_autograd_grad_inside_matches_torch(seeded):
    # The example and torch's nested form c(grad(sum(c(hc)))), against
    # torch.utils.checkpoint (no tracker streams here, so torch replays everything too).
    import torch.utils.checkpoint as tc

    def penalty(ckpt):
        def fn(x):
            y = x.sin().exp()
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return g

        return fn

    def nested(ckpt):
        def fn(x):
            y = ckpt(lambda t: F.dropout(t.cos(), P), x)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return ckpt(torch.sin, g) * y

        return fn

    ours = lambda f, *a: checkpoint(f, False, *a, use_reentrant=False)  # noqa: E731
    theirs = lambda f, *a: tc.checkpoint(f, *a, use_reentrant=False)  # noqa: E731
    for make in (penalty, nested):
        results = []
        for ckpt in (ours, theirs):
            set_rng_snapshot(seeded)
            x = torch.randn(3, 4, requires_grad=True)
            out = ckpt(make(ckpt), x)
            out.sum().backward()
            results.append((out.detach(), x.grad))
        assert torch.equal(results[0][0], results[1][0]), make.__name__
        assert torch.equal(results[0][1], results[1][1]), make.__name__


# --- debug=True -----------------------------------------------------------------------------------


def test_debug_shows_the_first_differing_op(seeded):
    rows = {"n": 2}  # state read by the region that changes between forward and backward

    def region(x):
        h = F.dropout(x * 3, P)
        return h[: rows["n"]].exp()

    x = torch.randn(4, 5, requires_grad=True)
    set_rng_snapshot(seeded)  # debug changes nothing when the recompute agrees
    want = F.dropout(x * 3, P)[:2].exp()
    want.sum().backward()
    want_grad, x.grad = x.grad, None
    set_rng_snapshot(seeded)
    out = checkpoint(region, False, x, use_reentrant=False, debug=True)
    out.sum().backward()
    assert torch.equal(out, want) and torch.equal(x.grad, want_grad)

    out = checkpoint(region, False, x, use_reentrant=False, debug=True)
    rows["n"] = 3
    with pytest.raises(MegatronCoreError) as e:
        out.sum().backward()
    message = str(e.value)
    assert "saved tensor #1: forward had torch.float32 [2, 5], recompute torch.float32 [3, 5]" in (
        message
    )
    # The forward and recompute logs part at the slice, shown with the shapes on each side.
    first = re.search(r"first differing op is #(\d+)", message)
    assert first is not None, message
    n = first.group(1)
    assert re.search(rf"forward:\n(.*\n)*    #{n} aten\.slice\.Tensor -> float32\[2, 5\]", message)
    assert re.search(
        rf"recompute:\n(.*\n)*    #{n} aten\.slice\.Tensor -> float32\[3, 5\]", message
    )
    # Without debug the error names the tensor but shows no op log.
    rows["n"] = 2
    out = checkpoint(region, False, x, use_reentrant=False)
    rows["n"] = 3
    with pytest.raises(MegatronCoreError, match="saved tensor #1") as e:
        out.sum().backward()
    assert "first differing op" not in str(e.value)


def test_debug_reports_a_recompute_that_saves_more(seeded):
    extra = {"on": False}

    def region(x):
        h = x.sin()
        if extra["on"]:
            h = h.cos()
        return h * x

    x = torch.randn(3, requires_grad=True)
    out = checkpoint(region, False, x, use_reentrant=False, debug=True, early_stop=False)
    extra["on"] = True
    with pytest.raises(MegatronCoreError, match=r"(?s)first differing op is #1 .*aten\.cos"):
        out.sum().backward()


# --- selective checkpointing through torch's context_fn -------------------------------------------


def _sac_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    aten = torch.ops.aten
    return create_selective_checkpoint_contexts([aten.mm.default, aten.addmm.default])


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _body_selective() -> list[str]:
    layers, inputs, mask = _setup()
    snapshot = get_rng_snapshot()

    def step(run):
        set_rng_snapshot(snapshot)
        layers.zero_grad(set_to_none=True)
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = run(layers, *leaves, mask)
        with _CountMatmuls() as count:
            (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads = [t.grad for t in leaves] + [p.grad for p in layers.parameters()]
        return [out.detach(), *grads, torch.rand(3)], count.n

    want, plain_matmuls = step(_plain)
    problems = []
    for split in (False, True):
        for early_stop in (True, False):
            kw = {"use_reentrant": False, "context_fn": _sac_context, "early_stop": early_stop}
            got, matmuls = step(_each(split, **kw))
            name = f"selective, distributed={split}, early_stop={early_stop}"
            if not all(torch.equal(a, b) for a, b in zip(want, got)):
                problems.append(f"{name}: differs from the plain stack")
            if matmuls != plain_matmuls:  # the policy saves every matmul: none is recomputed
                problems.append(f"{name}: {matmuls} matmuls in backward, plain {plain_matmuls}")
    _, matmuls = step(_each(True, use_reentrant=False, early_stop=False))
    if matmuls <= plain_matmuls:
        problems.append("the control (no policy) recomputed no matmul: the count is broken")
    return problems


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_selective_checkpoint_context_fn(world_size):
    for rank, problems in enumerate(run_distributed(_body_selective, world_size, timeout=240)):
        assert problems == [], f"rank {rank}: {problems}"


# --- checkpoint_sequential ------------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_sequential_matches_torch(seeded, use_reentrant):
    import torch.utils.checkpoint as tc

    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(6, 6), nn.Dropout(P))])
    x0 = torch.randn(4, 6)
    results = []
    for run in (checkpoint_sequential, tc.checkpoint_sequential, None):
        set_rng_snapshot(seeded)
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = model(x) if run is None else run(model, 4, x, use_reentrant=use_reentrant)
        out.sum().backward()
        results.append([out, x.grad, *[p.grad for p in model.parameters()], torch.rand(2)])
    for name, got in (("torch", results[1]), ("plain", results[2])):
        assert all(torch.equal(a, b) for a, b in zip(results[0], got)), name


def test_checkpoint_sequential_bad_segments(seeded):
    fns = [torch.sin, torch.cos]
    x = torch.randn(3, requires_grad=True)
    for bad in (0, 3):
        with pytest.raises(MegatronCoreError, match=rf"segments \({bad}\) must be between 1 and"):
            checkpoint_sequential(fns, bad, x, use_reentrant=False)
    with pytest.warns(UserWarning, match="pass use_reentrant explicitly"):
        out = checkpoint_sequential(fns, 2, x)
    assert torch.equal(out, x.sin().cos())


# --- early stop -----------------------------------------------------------------------------------


def _tail_region(x, w):
    """Its last saved tensor is the matmul's input: what follows is never recomputed with
    early stop, including draws from the default stream and inside the tracker fork."""
    with get_cuda_rng_tracker().fork():
        h = F.dropout(x.exp(), P)
        y = (h @ w) + torch.rand(x.shape[0], w.shape[1])  # mm saves h and w before it runs
    return y + torch.rand(1)


def _tail_step(seeded, run):
    set_rng_snapshot(seeded)
    x = torch.linspace(-1, 1, 12).view(3, 4).requires_grad_()
    w = torch.linspace(-2, 1, 20).view(4, 5).requires_grad_()
    out = run(x, w)
    with _CountMatmuls() as count:
        out.sum().backward(retain_graph=True)
        first = [x.grad.clone(), w.grad.clone()]
        out.sum().backward()
    draws = [torch.rand(3)]
    with get_cuda_rng_tracker().fork():
        draws.append(torch.rand(3))
    return [out, *first, x.grad, w.grad, *draws], count.n


def test_early_stop_skips_the_tail_and_keeps_every_stream(seeded):
    import torch.utils.checkpoint as tc

    want, plain = _tail_step(seeded, _tail_region)
    counts = {}
    cases = {
        "on": lambda x, w: checkpoint(_tail_region, False, x, w, use_reentrant=False),
        "off": lambda x, w: checkpoint(
            _tail_region, False, x, w, use_reentrant=False, early_stop=False
        ),
    }
    for name, run in cases.items():
        got, counts[name] = _tail_step(seeded, run)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), name
    # Two backward passes, each recomputes once; only "off" recomputes the matmul.
    assert counts["on"] == plain and counts["off"] == plain + 2
    # Switchable globally, ours and torch's context manager alike.
    for switch in (set_checkpoint_early_stop, tc.set_checkpoint_early_stop):
        with switch(False):
            got, n = _tail_step(seeded, cases["on"])
        assert n == plain + 2 and all(torch.equal(a, b) for a, b in zip(want, got))


# --- recomputed tensors freed after their last use ------------------------------------------------


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every storage an op produced that is still alive; peak taken during backward.

    A storage's Python object lives exactly as long as the storage (torch preserves it), so a
    weak reference to it tells whether the memory is still held by anyone.
    """

    def __init__(self):
        super().__init__()
        self.refs, self.peak, self.in_backward = {}, 0, False

    def live(self) -> int:
        return sum(n for ref, n in self.refs.values() if ref() is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs[id(storage)] = (weakref.ref(storage), storage.nbytes())
        if self.in_backward:
            self.peak = max(self.peak, self.live())
        return out


def test_bytes_alive_during_backward_as_torch():
    # No tracker streams: torch keeps no copies of them, so like is compared with like (ours
    # would add one RNG-state copy per stream, 5 KB each, to what is alive).
    import torch.utils.checkpoint as tc

    assert not get_cuda_rng_tracker().states_
    torch.manual_seed(SEED)

    blocks = nn.ModuleList(
        [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(4)]
    )

    def measure(ckpt, retain_graph):
        blocks.zero_grad(set_to_none=True)
        with _LiveBytes() as live:  # the input is made inside: every mode counts it
            h = torch.randn(128, 64, requires_grad=True)
            for block in blocks:
                h = h + ckpt(block, h)
            live.in_backward = True
            h.sum().backward(retain_graph=retain_graph)
            after = live.live()
        return live.peak, after

    ours = lambda f, h: checkpoint(f, False, h, use_reentrant=False)  # noqa: E731
    theirs = lambda f, h: tc.checkpoint(f, h, use_reentrant=False)  # noqa: E731
    plain = lambda f, h: f(h)  # noqa: E731
    for run in (ours, theirs, plain):  # first calls allocate lazily (caches): not measured
        measure(run, False)
    for retain_graph in (False, True):
        (peak, after), (torch_peak, torch_after) = (
            measure(ours, retain_graph),
            measure(theirs, retain_graph),
        )
        plain_peak, plain_after = measure(plain, retain_graph)
        assert peak <= torch_peak < plain_peak, (retain_graph, peak, torch_peak, plain_peak)
        # After a backward that keeps the graph, nothing recomputed is still held.
        assert after <= torch_after, (retain_graph, after, torch_after)
        if retain_graph:
            assert torch_after < plain_after


def test_rng_snapshots_are_shared_until_a_stream_moves(seeded):
    from megatron_core.tensor_parallel.recompute.saved_inputs import ForwardState

    a, b = ForwardState.capture(), ForwardState.capture()
    assert a.rng.tracker_states is b.rng.tracker_states  # nothing moved: one copy
    with get_cuda_rng_tracker().fork():
        torch.rand(1)
        inside = ForwardState.capture()  # a stream in flight: copied afresh
    c = ForwardState.capture()
    assert inside.rng.tracker_states is not b.rng.tracker_states
    assert c.rng.tracker_states is not b.rng.tracker_states
    name = "model-parallel-rng"
    assert not torch.equal(c.rng.tracker_states[name], b.rng.tracker_states[name])


# --- megatron-core 0.16 names: checkpoint(fn, None, ...), is_checkpointing, the Function ------


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_megatron_core_0_16_names(seeded, use_reentrant):
    from megatron_core.tensor_parallel import random as tp_random

    seen = []

    def region(t):
        seen.append(tp_random.is_checkpointing())
        return F.dropout(t.sin(), P) * t

    x = torch.randn(5, requires_grad=True)
    set_rng_snapshot(seeded)
    want = region(x)
    want.sum().backward()
    want_grad, x.grad = x.grad, None
    assert seen == [False] and not tp_random.is_checkpointing()
    set_rng_snapshot(seeded)
    out = tp_random.checkpoint(region, None, x, use_reentrant=use_reentrant)  # None: False
    assert not tp_random.is_checkpointing()
    out.sum().backward()
    # True in the region's forward and in its recompute, False after.
    assert seen == [False, True, True] and not tp_random.is_checkpointing()
    assert torch.equal(out, want) and torch.equal(x.grad, want_grad)


def test_checkpoint_without_output_function_as_megatron_core_calls_it(seeded):
    from megatron_core.tensor_parallel.random import CheckpointWithoutOutputFunction

    x = torch.randn(4, 3, requires_grad=True)
    owner = CheckpointWithoutOutput()
    out = owner.checkpoint(torch.sin, x)
    ctx = owner.ctx  # set by CheckpointWithoutOutputFunction.forward, as in megatron-core
    assert isinstance(out.grad_fn, CheckpointWithoutOutputFunction._backward_cls)
    assert ctx.inputs is None and ctx.outputs is None
    owner._recompute(None)  # what the gradient hook calls: fills ctx.inputs / ctx.outputs
    assert owner.ctx is None and torch.equal(ctx.outputs[0], x.sin())
    (out * 2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.cos(), rtol=0, atol=0)
    assert ctx.inputs is None and ctx.outputs is None  # released by backward
