"""megatron_core.utils: megatron-core 0.16.1's helpers (megatron.core.utils), same behaviour.

Pure helpers are compared with megatron-core's own functions (installed in CI); the group helpers,
the embedding-wgrad drain and the sharded-tensor factories run on 1, 2 and 4 gloo ranks.
"""

import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core import utils
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed
from megatron_core.utils import nvtx


@pytest.fixture(scope="module")
def mc_utils():
    """megatron-core's own module (imported in this process only: the ranks never import it)."""
    return pytest.importorskip("megatron.core.utils")


# --- pure helpers, compared with megatron-core's -------------------------------------------------


def test_divide_and_versions_match_megatron(mc_utils):
    assert utils.divide(12, 4) == mc_utils.divide(12, 4) == 3
    for module in (utils, mc_utils):
        with pytest.raises(AssertionError, match="10.*4"):
            module.divide(10, 4)
    assert utils.get_torch_version() == mc_utils.get_torch_version()
    for v in ("1.13.0", "2.13.0", torch.__version__, "2.13.1", "99.0"):
        for eq in (True, False):
            assert utils.is_torch_min_version(v, eq) == mc_utils.is_torch_min_version(v, eq), v
    assert utils.get_te_version() is None  # no Transformer Engine in CI
    assert utils.is_te_min_version("1.0") is False  # megatron-core: TypeError (None >= Version)


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = "cfg"
        self.model_type = "mt"
        self.empty = None


class _Wrapper(torch.nn.Module):
    def __init__(self, module, **attrs):
        super().__init__()
        self.module = module
        for k, v in attrs.items():
            setattr(self, k, v)


@pytest.mark.parametrize(
    "attr, kwargs",
    [
        ("config", {}),
        ("config", {"allow_none": False}),
        ("model_type", {"return_model_obj": True}),
        ("empty", {}),
        ("empty", {"allow_none": False}),
        ("missing", {}),
    ],
)
def test_get_attr_wrapped_model_matches_megatron(attr, kwargs, mc_utils):
    inner = _Inner()
    model = _Wrapper(_Wrapper(inner, config=None), empty=None)

    def outcome(module):
        try:
            return "value", module.get_attr_wrapped_model(model, attr, **kwargs)
        except RuntimeError:
            return "RuntimeError", None

    assert outcome(utils) == outcome(mc_utils)
    for module in (utils, mc_utils):
        with pytest.raises(RuntimeError):
            module.get_attr_wrapped_model([model], attr)
        assert module.get_model_config(model) == "cfg"  # the wrapper's config=None is skipped
        assert module.get_model_type(model) == "mt"
        assert module.get_model_xattn(model) is False


def test_group_helpers_without_torch_distributed(mc_utils):
    assert not dist.is_initialized()
    for module in (utils, mc_utils):
        assert module.get_pg_size(None) == 1 and module.get_pg_rank(None) == 0
        assert module.get_pg_src_rank(None) == 0
        assert module.get_tensor_model_parallel_group_if_none(None) is None


def test_make_viewless_tensor_matches_megatron(mc_utils):
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:3]
    for keep_graph in (False, True):
        ours = utils.make_viewless_tensor(view, requires_grad=True, keep_graph=keep_graph)
        theirs = mc_utils.make_viewless_tensor(view, requires_grad=True, keep_graph=keep_graph)
        assert ours._base is None and theirs._base is None
        assert ours.data_ptr() == view.data_ptr() == theirs.data_ptr()  # same memory
        assert ours.shape == theirs.shape and ours.requires_grad == theirs.requires_grad
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    plain = torch.ones(3)
    assert utils.make_viewless_tensor(plain, False, False) is plain  # not a view: unchanged
    # keep_graph: the gradient flows to the view's source
    src = torch.ones(4, 6, requires_grad=True)
    out = utils.make_viewless_tensor(src[:2] * 1, requires_grad=True, keep_graph=True)
    out = utils.make_viewless_tensor(out.view(12), requires_grad=True, keep_graph=True)
    (out * torch.arange(12.0)).sum().backward()
    torch.testing.assert_close(src.grad[:2].reshape(12), torch.arange(12.0))


def test_safely_set_viewless_tensor_data(mc_utils):
    t = torch.zeros(2)
    utils.safely_set_viewless_tensor_data(t, torch.ones(3))
    torch.testing.assert_close(t, torch.ones(3))
    view = torch.zeros(4)[:2]
    for module in (utils, mc_utils):
        with pytest.raises(AssertionError):
            module.safely_set_viewless_tensor_data(view, torch.ones(3))
    with pytest.raises(MegatronCoreError, match=r"\(2,\).*\(4,\).*\(3,\)"):
        utils.safely_set_viewless_tensor_data(view, torch.ones(3))
    assert utils.assert_viewless_tensor([t, "x"]) == [t, "x"]


@pytest.mark.parametrize("shape", [(3, 2, 5), (6, 5)])
def test_prepare_input_tensors_for_wgrad_compute_matches_megatron(shape, mc_utils):
    grad = torch.randn(*shape[:-1], 4).transpose(0, -1).contiguous().transpose(0, -1)
    inp = torch.randn(shape)
    ours = utils.prepare_input_tensors_for_wgrad_compute(grad, inp)
    theirs = mc_utils.prepare_input_tensors_for_wgrad_compute(grad, inp)
    for a, b in zip(ours, theirs):
        assert a.is_contiguous() and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _caller_pushes():
    utils.nvtx_range_push()
    utils.nvtx_range_pop()
    utils.nvtx_range_push(suffix="s")
    return list(nvtx._nvtx_range_messages)


def test_nvtx_ranges(monkeypatch):
    monkeypatch.setattr(nvtx, "_nvtx_range_messages", [])
    utils.nvtx_range_pop("never pushed")  # disabled (the default): nothing happens
    plain = lambda: 1  # noqa: E731
    assert utils.nvtx_decorator()(plain) is plain
    monkeypatch.setattr(nvtx, "_nvtx_enabled", False)
    utils.configure_nvtx_profiling(True)
    assert nvtx._nvtx_enabled
    assert _caller_pushes() == [f"{__name__}._caller_pushes.s"]
    with pytest.raises(ValueError, match="innermost"):
        utils.nvtx_range_pop("other")
    with pytest.raises(RuntimeError, match="no NVTX range"):
        utils.nvtx_range_pop("x")
    utils.nvtx_range_push("a", suffix="b")
    utils.nvtx_range_pop("a.b")  # on cpu the device ranges are no-ops
    wrapped = utils.nvtx_decorator(message="m")(plain)
    assert wrapped is not plain and wrapped() == 1
    utils.configure_nvtx_profiling(False)


def test_sharded_tensor_without_megatron_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.dist_checkpointing.mapping", None)
    for make in (
        utils.make_tp_sharded_tensor_for_checkpoint,
        utils.make_sharded_tensor_for_checkpoint,
    ):
        with pytest.raises(MegatronCoreError, match=r"\[megatron\]"):
            make(torch.zeros(2), "k", tp_group=object())


# --- on gloo ranks ------------------------------------------------------------------------------


def _body_group_helpers(tp):
    rank = dist.get_rank()
    assert utils.get_tensor_model_parallel_group_if_none(None) is None  # before initialization
    marker = object()
    assert utils.get_tensor_model_parallel_group_if_none(marker) is marker
    ps.initialize_model_parallel(tp, expert_tensor_parallel_size=1)
    tp_group = ps.get_tensor_model_parallel_group()
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert utils.get_tensor_model_parallel_group_if_none(None) is tp_group
        expert = utils.get_tensor_model_parallel_group_if_none(None, is_expert=True)
    assert expert is ps.get_expert_tensor_parallel_group()
    assert [w.category for w in caught] == ([DeprecationWarning] * 2 if rank == 0 else [])
    assert utils.get_tensor_model_parallel_group_if_none(dp_group) is dp_group
    assert utils.get_pg_size(tp_group) == tp and utils.get_pg_rank(tp_group) == rank % tp
    assert utils.get_pg_src_rank(tp_group) == rank - rank % tp
    assert utils.get_pg_src_rank(dp_group) == rank % tp
    # The sharded-tensor factories default to parallel_state's tp and dp x cp groups.
    from megatron_core.utils import tensors as _utils_tensors

    assert _utils_tensors._groups({}) == (tp_group, dp_group)
    assert _utils_tensors._groups({"tp_group": tp_group}) == (tp_group, None)


@pytest.mark.parametrize("world_size, tp", [(1, 1), (2, 2), (4, 2)])
def test_group_helpers(world_size, tp):
    run_distributed(_body_group_helpers, world_size, tp, timeout=120)


class _FakeGroup:
    """rank() and size() are all the factories read from a group."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _sharded_fields(st):
    return (
        st.key,
        st.global_shape,
        st.global_offset,
        st.axis_fragmentations,
        st.replica_id,
        st.prepend_axis_num,
        st.local_shape,
    )


@pytest.mark.parametrize("tp_size, dp_size", [(1, 1), (2, 1), (2, 2), (4, 1), (1, 4)])
def test_sharded_tensor_factories_match_megatron(tp_size, dp_size, mc_utils, monkeypatch):
    """Every (tp rank, dp rank) of 1-, 2- and 4-rank layouts: same ShardedTensor fields."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # get_pg_rank reads group.rank()
    shard = torch.arange(6.0).reshape(2, 3)
    cases = [
        {"tp_axis": 0},
        {"tp_axis": 1, "prepend_offsets": ((0, 1, 3),)},
        {"tp_axis": 1, "replica_id": (1, 2, 3)},
    ]
    for tp_rank in range(tp_size):
        for dp_rank in range(dp_size):
            groups = {
                "tp_group": _FakeGroup(tp_rank, tp_size),
                "dp_cp_group": _FakeGroup(dp_rank, dp_size),
            }
            for args in cases:
                ours = utils.make_tp_sharded_tensor_for_checkpoint(shard, "w", **args, **groups)
                theirs = mc_utils.make_tp_sharded_tensor_for_checkpoint(
                    shard, "w", **args, **groups
                )
                assert _sharded_fields(ours) == _sharded_fields(theirs), args
                assert ours.data is shard
            args = {"prepend_offsets": ((0, 0, 2),)}
            ours = utils.make_sharded_tensor_for_checkpoint(shard, "b", **args, **groups)
            theirs = mc_utils.make_sharded_tensor_for_checkpoint(shard, "b", **args, **groups)
            assert _sharded_fields(ours) == _sharded_fields(theirs)
            assert ours.replica_id == (0, tp_rank, dp_rank)


def _body_drain_embedding_wgrad(sequence_parallel, fusion):
    """Deferred output-layer wgrad of 3 microbatches == the unsharded sum of dY^T X."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(world)
    torch.manual_seed(0)  # every rank builds the same full tensors
    s, b, h, o = 4 * world, 2, 3, 5
    inputs = [torch.randn(s, b, h) for _ in range(3)]
    grads = [torch.randn(s, b, o) for _ in range(3)]
    weight = torch.nn.Parameter(torch.zeros(o, h))
    weight.main_grad = torch.full((o, h), 0.5)
    config = types.SimpleNamespace(
        sequence_parallel=sequence_parallel, gradient_accumulation_fusion=fusion
    )
    rows = s // world
    activations = [x[rank * rows : (rank + 1) * rows] if sequence_parallel else x for x in inputs]
    grad_buffer = list(grads)
    utils.drain_embedding_wgrad_compute(
        config, activations, grad_buffer, weight, ps.get_tensor_model_parallel_group()
    )
    assert activations == [] and grad_buffer == []
    expected = torch.full((o, h), 0.5)
    if fusion:
        for x, g in zip(inputs, grads):
            expected += g.reshape(-1, o).t() @ x.reshape(-1, h)
    # fp32 sums of 3 GEMMs in a different association than the reference: 1e-5 relative
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(MegatronCoreError, match="2 activations but 1"):
        utils.drain_embedding_wgrad_compute(config, [1, 2], [1], weight, None)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_drain_embedding_wgrad_compute(world_size):
    for sequence_parallel, fusion in ((True, True), (False, True), (True, False)):
        run_distributed(_body_drain_embedding_wgrad, world_size, sequence_parallel, fusion)
