"""Every region function on gloo ranks: forward and backward against hand-computed results.

Each rank builds the same full tensors X (input) and G (incoming gradient) from fixed seeds, takes
its shard, runs the region and compares with what the collective must give. Incoming gradients are
rank-dependent (G * (tp_rank + 1)), so a backward that sums shows the factor T = 1 + 2 + ... + tp,
one that does not shows tp_rank + 1. Expanded gradients (``out.sum().backward()``) check NOTE
[ Fresh contiguous buffers ] in mappings.py.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core import tensor_parallel as tp_api
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import _collectives
from megatron_core.testing import run_distributed

SHAPE = (8, 2, 8)  # [s, b, h]; s and h are divisible by 1, 2 and 4

# fp32: the collectives add at most 4 exactly representable partial results in fixed rank order,
# so only the last bit can differ from the hand computation (torch's default fp32 tolerance).
# bf16 keeps 8 significant bits: every one of up to 3 additions rounds by <= 2**-8 relative, and the
# expectation is computed in fp32 from the same bf16 inputs, so 2e-2 bounds it for tp <= 4.
TOLERANCE = {"float32": {}, "bfloat16": {"rtol": 2e-2, "atol": 2e-2}}

# World size -> tensor-parallel sizes run there (tp < world size: several TP groups at once).
CONFIGS = {1: [1], 2: [2, 1], 4: [4, 2]}


def _full(seed, shape, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def _run(fn, x, grad=None):
    """(fn(x), x.grad) with ``grad`` fed to the output (None: ``fn(x).sum().backward()``)."""
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    if grad is None:
        y.sum().backward()  # the incoming gradient is an expanded (stride-0) tensor
    else:
        y.backward(grad)
    return y.detach(), x.grad


def _check_tensor_regions(r, w, dtype, close):
    t = w * (w + 1) / 2
    X, G = _full(1, SHAPE, dtype), _full(2, SHAPE, dtype)
    ones = torch.ones(SHAPE, dtype=dtype)
    last = lambda a: a.chunk(w, dim=-1)[r]  # noqa: E731
    # f: identity forward, all-reduce backward.
    y, gx = _run(tp_api.copy_to_tensor_model_parallel_region, X, G * (r + 1))
    close(y, X)
    close(gx, G.float() * t)
    close(_run(tp_api.copy_to_tensor_model_parallel_region, X)[1], ones * w)
    # g: all-reduce forward, identity backward; the input is left untouched.
    x_in = X * (r + 1)
    before = x_in.clone()
    y, gx = _run(tp_api.reduce_from_tensor_model_parallel_region, x_in, G * (r + 1))
    close(y, X.float() * t)
    close(gx, G * (r + 1))
    assert torch.equal(x_in, before)
    # Scatter / gather along the last dimension.
    y, gx = _run(tp_api.scatter_to_tensor_model_parallel_region, X, last(G))
    close(y, last(X))
    assert y.is_contiguous()
    close(gx, G)
    y, gx = _run(tp_api.gather_from_tensor_model_parallel_region, last(X), G * (r + 1))
    close(y, X)
    close(gx, last(G) * (r + 1))
    # All-gather / reduce-scatter along the last dimension.
    y, gx = _run(tp_api.all_gather_last_dim_from_tensor_parallel_region, last(X), G * (r + 1))
    close(y, X)
    close(gx, last(G).float() * t)
    close(_run(tp_api.all_gather_last_dim_from_tensor_parallel_region, last(X))[1], last(ones) * w)
    y, gx = _run(tp_api.reduce_scatter_last_dim_to_tensor_parallel_region, X * (r + 1), last(G))
    close(y, last(X).float() * t)
    close(gx, G)


def _check_sequence_regions(r, w, dtype, close):
    t = w * (w + 1) / 2
    X, G = _full(3, SHAPE, dtype), _full(4, SHAPE, dtype)
    first = lambda a: a.chunk(w, dim=0)[r]  # noqa: E731
    y, gx = _run(tp_api.scatter_to_sequence_parallel_region, X, first(G))
    close(y, first(X))
    close(gx, G)
    gather = tp_api.gather_from_sequence_parallel_region
    y, gx = _run(gather, first(X), G * (r + 1))  # tensor_parallel_output_grad=True
    close(y, X)
    close(gx, first(G).float() * t)
    close(_run(gather, first(X))[1], first(torch.ones(SHAPE, dtype=dtype)) * w)
    replicated = partial(gather, tensor_parallel_output_grad=False)
    y, gx = _run(replicated, first(X), G * (r + 1))
    close(y, X)
    close(gx, first(G) * (r + 1))
    reduce_scatter = tp_api.reduce_scatter_to_sequence_parallel_region
    y, gx = _run(reduce_scatter, X * (r + 1), first(G))
    close(y, first(X).float() * t)
    close(gx, G)
    # Uneven parts: rank i holds i + 1 rows.
    sizes = [i + 1 for i in range(w)]
    rows = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
    Xu, Gu = _full(5, (sum(sizes), 3), dtype), _full(6, (sum(sizes), 3), dtype)
    y, gx = _run(partial(gather, output_split_sizes=sizes), Xu[rows], Gu * (r + 1))
    close(y, Xu)
    close(gx, Gu[rows].float() * t)
    uneven_replicated = partial(replicated, output_split_sizes=sizes)
    y, gx = _run(uneven_replicated, Xu[rows], Gu * (r + 1))
    close(gx, Gu[rows] * (r + 1))
    y, gx = _run(partial(reduce_scatter, input_split_sizes=sizes), Xu * (r + 1), Gu[rows])
    close(y, Xu[rows].float() * t)
    close(gx, Gu)


def _a2a_expected(data, counts, r):
    """What rank r receives: block (i -> r) of every rank i's data; counts[i][j] = rows i -> j."""
    w = len(counts)
    return torch.cat([data[i][sum(counts[i][:r]) :][: counts[i][r]] for i in range(w)])


def _check_all_to_all(r, w, dtype, close):
    group = ps.get_tensor_model_parallel_group()
    for counts in ([[2] * w] * w, [[i + j + 1 for j in range(w)] for i in range(w)]):
        data = [_full(10 + i, (sum(counts[i]), 3), dtype) for i in range(w)]
        back = [[counts[j][i] for j in range(w)] for i in range(w)]  # reverse direction
        grads = [_full(20 + i, (sum(back[i]), 3), dtype) for i in range(w)]
        fn = partial(
            tp_api.all_to_all,
            group,
            output_split_sizes_=back[r],
            input_split_sizes=counts[r],
        )
        y, gx = _run(lambda x, fn=fn: fn(x), data[r], grads[r])
        close(y, _a2a_expected(data, counts, r))
        close(gx, _a2a_expected(grads, back, r))
    # Equal split with the default split sizes.
    data = [_full(30 + i, (2 * w, 3), dtype) for i in range(w)]
    y, gx = _run(lambda x: tp_api.all_to_all(group, x), data[r], data[r] * 2)
    close(y, _a2a_expected(data, [[2] * w] * w, r))
    close(gx, _a2a_expected(data, [[2] * w] * w, r) * 2)
    _check_sp2hp_hp2sp(r, w, dtype, close)


def _check_sp2hp_hp2sp(r, w, dtype, close):
    """[tokens/tp, H] <-> [tokens, H/tp]: the full [tokens, H] matrix split the other way."""
    tokens, hidden = 2 * w, 4 * w
    full, grad = _full(40, (tokens, hidden), dtype), _full(41, (tokens, hidden), dtype)
    seq = lambda a: a.chunk(w, dim=0)[r]  # noqa: E731
    hid = lambda a: a.chunk(w, dim=-1)[r]  # noqa: E731
    # A 3-D [s/tp, b, H] input is flattened into tokens, as megatron-core does.
    x3 = seq(full).reshape(2, 1, hidden)
    y, gx = _run(lambda x: tp_api.all_to_all_sp2hp(x), x3, hid(grad))
    close(y, hid(full))
    close(gx, seq(grad).reshape(2, 1, hidden))
    y, gx = _run(lambda x: tp_api.all_to_all_hp2sp(x), hid(full), seq(grad))
    close(y, seq(full))
    close(gx, hid(grad))


def _check_errors(w):
    """Bad shapes raise on every rank before any collective (so no rank hangs)."""
    bad = torch.zeros(w + 1 if w > 1 else 1, 3 * w + 1)
    checks = [
        (tp_api.scatter_to_tensor_model_parallel_region, r"last dimension \(\d+\)"),
        (tp_api.scatter_to_sequence_parallel_region, r"first dimension \(\d+\)"),
        (tp_api.reduce_scatter_to_sequence_parallel_region, r"first dimension \(\d+\)"),
        (tp_api.reduce_scatter_last_dim_to_tensor_parallel_region, r"last dimension \(\d+\)"),
        (partial(tp_api.all_to_all, ps.get_tensor_model_parallel_group()), "all_to_all"),
        (
            partial(tp_api.gather_from_sequence_parallel_region, output_split_sizes=[1]),
            r"output_split_sizes \(\[1\]\)",
        ),
    ]
    for fn, message in checks:
        with pytest.raises(MegatronCoreError, match=message):
            fn(bad)
    with pytest.raises(MegatronCoreError, match="group must be a process group"):
        tp_api.all_to_all(None, bad)


def _check_tp1_is_noop():
    x = torch.randn(3, 4, requires_grad=True)
    for name in tp_api.mappings.__all__:
        fn = getattr(tp_api, name)
        y = fn(ps.get_tensor_model_parallel_group(), x) if name == "all_to_all" else fn(x)
        if name in ("all_to_all_sp2hp", "all_to_all_hp2sp"):  # these flatten to [tokens, H]
            torch.testing.assert_close(y, x.reshape(-1, x.shape[-1]), rtol=0, atol=0)
        else:
            assert y is x, name


def _body(tp_sizes, dtype_name):
    dtype = getattr(torch, dtype_name)

    def close(actual, expected):  # expectations are computed in fp32 (see TOLERANCE)
        assert actual.dtype == dtype, (actual.dtype, dtype)
        torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype_name])

    for tp in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        r, w = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        if w == 1:
            _check_tp1_is_noop()
        else:
            _check_tensor_regions(r, w, dtype, close)
            _check_sequence_regions(r, w, dtype, close)
            _check_all_to_all(r, w, dtype, close)
            _check_errors(w)
        ps.destroy_model_parallel()
    # An explicit group= overrides the tensor-parallel group: sum over the whole world.
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    x = torch.ones(2, dtype=dtype) * (rank + 1)
    y = tp_api.reduce_from_tensor_model_parallel_region(x, group=dist.group.WORLD)
    close(y, torch.full((2,), world * (world + 1) / 2, dtype=dtype))
    return True


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_regions_forward_and_backward(world_size, dtype_name):
    results = run_distributed(_body, world_size, CONFIGS[world_size], dtype_name, timeout=120)
    assert results == [True] * world_size


def _half_sums(dtype_name):
    """Sums of half-precision values are exactly rounded and equal in every element.

    See NOTE [ Half-precision sums ] in _collectives.py: every rank contributes 1 + r * 2**-7
    (exact in bf16 and fp16); the exact fp32 sum rounded once to the dtype is the only right
    answer, so the comparison has zero tolerance.
    """
    dtype = getattr(torch, dtype_name)
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    r, w = dist.get_rank(), dist.get_world_size()
    x = torch.full((8, 4), 1.0 + r * 2**-7, dtype=dtype)
    x[0] = 256.0 if r == 0 else 0.5
    expected_row = torch.full((4,), sum(1.0 + i * 2**-7 for i in range(w)))
    expected = expected_row.expand(8, 4).clone()
    expected[0] = 256.0 + 0.5 * (w - 1)
    exact_sum, expected = expected, expected.to(dtype)
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(
        tp_api.reduce_from_tensor_model_parallel_region(x), expected, **exact
    )
    rs = tp_api.reduce_scatter_to_sequence_parallel_region(x)
    torch.testing.assert_close(rs, expected.chunk(w, dim=0)[r], **exact)
    uneven = [8 - (w - 1)] + [1] * (w - 1)
    rs = tp_api.reduce_scatter_to_sequence_parallel_region(x, input_split_sizes=uneven)
    torch.testing.assert_close(rs, expected.split(uneven, dim=0)[r], **exact)
    rs = tp_api.reduce_scatter_last_dim_to_tensor_parallel_region(x.t().contiguous())
    torch.testing.assert_close(rs, expected.t().chunk(w, dim=-1)[r], **exact)
    # owned=True: a buffer handed over is reduced in place unless it must be upcast (half on gloo).
    group = ps.get_tensor_model_parallel_group()
    for dtype_ in (torch.float32, dtype):
        mine, kept = x.to(dtype_), x.to(dtype_).clone()
        total = _collectives.all_reduce_async(mine, group, owned=True).wait()
        torch.testing.assert_close(total, exact_sum.to(dtype_), **exact)
        upcast = dtype_ != torch.float32 and _collectives.backend_for(mine, group) == "gloo"
        assert (total is mine) == (not upcast)
        _collectives.all_reduce_async(kept, group).wait()  # not owned: never written
        torch.testing.assert_close(kept, x.to(dtype_), **exact)
    return True


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_half_precision_sums_are_exactly_rounded(world_size, dtype_name):
    assert run_distributed(_half_sums, world_size, dtype_name, timeout=120) == [True] * world_size


def test_default_group_needs_parallel_state():
    with pytest.raises(MegatronCoreError, match="initialize_model_parallel"):
        tp_api.copy_to_tensor_model_parallel_region(torch.ones(2))


def test_half_sums_upcast_where_gloo_carries_the_tensor(monkeypatch):
    # A per-device map (the CUDA harness's cuda:nccl,cpu:gloo) carries CPU tensors over gloo.
    half = torch.ones(2, dtype=torch.bfloat16)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cuda:nccl,cpu:gloo")
    assert _collectives.backend_for(half, None) == "gloo"
    assert _collectives._sum_dtype(half, None) == torch.float32
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert _collectives._sum_dtype(half, None) == torch.bfloat16
    assert _collectives._sum_dtype(half.float(), None) == torch.float32
