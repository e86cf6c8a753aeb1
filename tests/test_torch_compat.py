"""megatron_core.compat (torch's version read with its labels, the fallbacks for torch releases
older than the APIs this package uses: run for real on the floor lane, torch 2.6), and the
half-precision initialization that differs between torch releases, and the Python 3.10 stand-in
for ``co_qualname`` in the consistency texts."""

import pytest
import torch

from megatron_core import compat
from megatron_core.consistency.text import qualname_by_lookup
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.layer_params import init_from_fp32_draw


@pytest.mark.parametrize(
    "text, release",
    [
        ("2.10.0a0+git1a2b3c", (2, 10, 0)),  # NVIDIA's container builds
        ("2.9.0a0+50eac811a6.nv25.09", (2, 9, 0)),
        ("2.11.0+cu130", (2, 11, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.15.0.dev20260101+cu132", (2, 15, 0)),
        ("2.6.0rc1", (2, 6, 0)),
        ("2.6", (2, 6, 0)),
        ("3", (3, 0, 0)),
    ],
)
def test_versions_with_local_and_prerelease_labels(text, release):
    assert compat.parse_torch_version(text) == release


def test_a_version_without_a_release_number_is_refused():
    with pytest.raises(MegatronCoreError, match=r"torch version 'nightly' does not start"):
        compat.parse_torch_version("nightly")


def test_at_least_counts_a_prerelease_of_the_release(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0a0+git1a2b3c")
    assert compat.torch_at_least(2, 10) and compat.torch_at_least(2, 6)
    assert not compat.torch_at_least(2, 10, 1) and not compat.torch_at_least(2, 11)
    with pytest.raises(
        MegatronCoreError,
        match=r"the widget needs torch >= 2\.11; this is torch "
        r"2\.10\.0a0\+git1a2b3c",
    ):
        compat.require_torch("the widget", 2, 11)
    compat.require_torch("the widget", 2, 10)


def test_installed_torch_is_at_least_the_floor():
    assert compat.torch_version() >= (*compat.FLOOR, 0)



def _normal(tensor):
    torch.nn.init.normal_(tensor, mean=0.0, std=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64,), (33, 17), (5,)])
def test_half_init_is_the_fp32_draw_rounded(dtype, shape):
    # torch's half kernels draw otherwise than fp32 (CPU torch <= 2.11 always; 2.13 for sizes
    # off its vector width), so the package draws half parameters in fp32 (layer_params).
    torch.manual_seed(7)
    full = torch.empty(shape)
    _normal(full)
    after_full = torch.rand(3)
    torch.manual_seed(7)
    half = torch.empty(shape, dtype=dtype)
    init_from_fp32_draw(_normal, half)
    assert torch.equal(half, full.to(dtype))
    assert torch.equal(torch.rand(3), after_full)  # the same RNG consumed: later draws agree


def test_fp32_init_is_untouched():
    torch.manual_seed(3)
    a = torch.empty(8)
    init_from_fp32_draw(_normal, a)
    torch.manual_seed(3)
    assert torch.equal(a, torch.empty(8).normal_(0.0, 0.02))


class _Owner:
    def method(self):
        return self

    @staticmethod
    def static():
        return None

    @classmethod
    def klass(cls):
        return cls


def _top_level():
    def nested():
        return None

    return nested


@pytest.mark.parametrize(
    "function, name",
    [
        (_Owner.method, "_Owner.method"),
        (_Owner.static, "_Owner.static"),
        (_Owner.klass, "_Owner.klass"),
        (_top_level, "_top_level"),
        (_top_level(), "nested"),  # not reachable from the module: its bare name
    ],
)
def test_python_310_qualname_stand_in(function, name):
    # consistency's error texts name the package functions on the stack; Python 3.10 code
    # objects have no co_qualname, so the name is looked up in the function's module.
    code = getattr(function, "__func__", function).__code__
    assert qualname_by_lookup(code, globals()) == name


@pytest.mark.parametrize("torch_default", [None, True])  # torch >= 2.7 / torch 2.6
def test_checkpoint_early_stop_override(torch_default, monkeypatch):
    import torch.utils.checkpoint as tuc

    monkeypatch.setattr(compat, "_EARLY_STOP_DEFAULT", torch_default)
    monkeypatch.setattr(tuc, "_enable_checkpoint_early_stop", torch_default)
    assert compat.checkpoint_early_stop_override() is None  # nothing set: the argument decides
    monkeypatch.setattr(tuc, "_enable_checkpoint_early_stop", False)
    assert compat.checkpoint_early_stop_override() is False
    monkeypatch.setattr(tuc, "_enable_checkpoint_early_stop", True)
    # torch 2.6 cannot tell a True set by set_checkpoint_early_stop from its default.
    assert compat.checkpoint_early_stop_override() is (None if torch_default else True)


def test_torchs_early_stop_context_is_honoured():
    import torch.utils.checkpoint as tuc

    with tuc.set_checkpoint_early_stop(False):
        assert compat.checkpoint_early_stop_override() is False
    assert compat.checkpoint_early_stop_override() is None
