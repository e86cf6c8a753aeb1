"""device.py's CUDA branches on a CPU-only build, against a fake, lazily initialized torch.cuda.

The fake behaves like torch's lazy CUDA init (NOTE [ CUDA first call ] in device.py):
``torch.cuda.default_generators`` is an empty tuple until ``init()`` or a call that initializes
CUDA (``current_device``, ``get_rng_state``, ...) runs. Its generators are CPU ``torch.Generator``
objects standing in for the GPUs'. So a CPU CI run covers the first-call ordering that once made
seeding on a fresh GPU process raise IndexError, plus backend detection and the overlap warning.
"""

import types
import warnings

import pytest
import torch

from megatron_core import device
from megatron_core.tensor_parallel import random as tp_random
from megatron_core.tensor_parallel.linear.autograd import (
    linear_with_grad_accumulation_and_async_allreduce,
)


class FakeCuda:
    """A two-GPU torch.cuda whose state exists only after (lazy) initialization."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.initialized = False
        self.index = 0
        self.init_calls = 0
        monkeypatch.setattr(torch.cuda, "default_generators", ())
        for name in (
            "is_available",
            "device_count",
            "init",
            "current_device",
            "set_device",
            "get_rng_state",
            "set_rng_state",
            "manual_seed",
            "synchronize",
            "memory_allocated",
            "max_memory_allocated",
            "reset_peak_memory_stats",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self):
        return True

    def device_count(self):
        return 2

    def init(self):
        self.init_calls += 1
        if not self.initialized:
            self.initialized = True
            gens = tuple(torch.Generator().manual_seed(1000 + i) for i in range(2))
            self.monkeypatch.setattr(torch.cuda, "default_generators", gens)

    def current_device(self):
        self.init()
        return self.index

    def set_device(self, index):
        self.index = index

    def _generator(self):
        self.init()
        return torch.cuda.default_generators[self.index]

    def get_rng_state(self):
        return self._generator().get_state()

    def set_rng_state(self, state):
        self._generator().set_state(state)

    def manual_seed(self, seed):
        self._generator().manual_seed(seed)

    def synchronize(self):
        self.init()

    def memory_allocated(self):
        return 7

    def max_memory_allocated(self):
        return 11

    def reset_peak_memory_stats(self):
        self.init()


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.delenv("MEGATRON_CORE_DEVICE", raising=False)
    fake = FakeCuda(monkeypatch)
    device.set_device_type("cuda")
    yield fake
    device.set_device_type(None)


def test_device_generator_as_the_first_cuda_call_initializes_cuda(fake_cuda):
    assert torch.cuda.default_generators == ()  # nothing has initialized CUDA yet
    gen = device.device_generator()
    assert fake_cuda.initialized
    assert gen is torch.cuda.default_generators[0]


def test_seeding_the_rng_tracker_is_a_valid_first_cuda_call(fake_cuda):
    tracker = tp_random.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)  # was IndexError on an uninitialized CUDA
    with tracker.fork("model-parallel-rng"):
        drawn = torch.rand(3, generator=device.device_generator())
    expected = torch.rand(3, generator=torch.Generator().manual_seed(123))
    torch.testing.assert_close(drawn, expected, rtol=0, atol=0)  # the same stream, bitwise


def test_current_device_follows_set_current_device(fake_cuda):
    device.set_current_device(3)  # local rank 3 on a two-GPU machine -> GPU 1
    assert device.current_device() == torch.device("cuda", 1)
    assert device.device_generator() is torch.cuda.default_generators[1]
    assert device.is_accelerator() and device.default_backend() == "nccl"


def test_mixed_backend_maps_cuda_to_nccl_and_cpu_to_gloo(fake_cuda):
    assert device.mixed_backend() == "cuda:nccl,cpu:gloo"  # the harness's cuda-mode group
    assert device.backend_uses_cuda(device.mixed_backend())
    device.set_device_type("cpu")
    assert device.mixed_backend() == "gloo"


def test_rng_round_trip_and_seed_stay_on_the_gpu_generator(fake_cuda):
    cpu_before = torch.get_rng_state()
    device.manual_seed(5)
    state = device.get_rng_state()
    first = torch.rand(4, generator=device.device_generator())
    device.set_rng_state(state)
    again = torch.rand(4, generator=device.device_generator())
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(torch.get_rng_state(), cpu_before, rtol=0, atol=0)


def test_memory_and_synchronize_go_to_torch_cuda(fake_cuda):
    device.synchronize()
    device.reset_peak_memory_stats()
    assert (device.memory_allocated(), device.max_memory_allocated()) == (7, 11)
    assert device.allocated_bytes() == 7  # the allocator's own count: no census on CUDA


@pytest.mark.parametrize(
    "backend, expected",
    [
        ("nccl", True),
        ("NCCL", True),
        ("cuda:nccl,cpu:gloo", True),
        ("cpu:gloo,cuda:nccl", True),
        ("cpu:gloo, cuda:nccl", True),
        ("gloo", False),
        ("cpu:gloo", False),
        ("cpu:gloo,cuda:gloo", False),  # what get_backend_config() says for init("gloo")
        ("mpi", False),
        ("", False),
        (None, False),
    ],
)
def test_backend_uses_cuda(backend, expected):
    assert device.backend_uses_cuda(backend) is expected


@pytest.mark.parametrize("config", ["nccl", "cuda:nccl,cpu:gloo"])
def test_an_initialized_nccl_group_selects_cuda(fake_cuda, monkeypatch, config):
    device.set_device_type(None)  # detect, as a launched job does
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: config)
    assert device.device_type() == "cuda"
    assert device.default_backend() == "nccl"
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    assert device.device_type() == "cpu"


def _cuda_like():
    return types.SimpleNamespace(device=torch.device("cuda", 0))


def test_overlap_warning_once_per_feature_only_for_cuda(monkeypatch):
    monkeypatch.setattr(device, "_OVERLAP_WARNED", set())
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device.warn_if_overlap_is_serialized(torch.ones(1), "sequence parallelism")  # cpu
        device.warn_if_overlap_is_serialized(_cuda_like(), "sequence parallelism")
        device.warn_if_overlap_is_serialized(_cuda_like(), "sequence parallelism")
    assert len(caught) == 1
    assert "CUDA_DEVICE_MAX_CONNECTIONS to 1" in str(caught[0].message)
    assert "sequence parallelism" in str(caught[0].message)
    monkeypatch.setattr(device, "_OVERLAP_WARNED", set())
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device.warn_if_overlap_is_serialized(_cuda_like(), "sequence parallelism")
    assert caught == []


def test_linear_function_asks_for_the_overlap_check(monkeypatch):
    calls = []
    monkeypatch.setattr(device, "warn_if_overlap_is_serialized", lambda t, f: calls.append(f))
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    # allreduce_dgrad communicates only in backward, so forward needs no process group.
    linear_with_grad_accumulation_and_async_allreduce(
        x, w, None, False, allreduce_dgrad=True, sequence_parallel=False, tp_group=object()
    )
    linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, False, False)
    assert calls == ["async tensor-model-parallel all-reduce"]


def _world_size():
    return torch.distributed.get_world_size()


def test_harness_cuda_mode_skips_without_a_gpu(monkeypatch):
    from megatron_core.testing import run_distributed

    monkeypatch.setenv("MEGATRON_CORE_TEST_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="needs a GPU, this machine has none"):
        run_distributed(_world_size, 2)


def test_harness_cuda_mode_shares_gpus_over_gloo(monkeypatch):
    from megatron_core.testing.worker import harness_backend

    monkeypatch.setenv("MEGATRON_CORE_TEST_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [harness_backend(n) for n in (1, 2, 4)] == ["cuda:nccl,cpu:gloo"] * 2 + ["gloo"]
    monkeypatch.setenv("MEGATRON_CORE_TEST_DEVICE", "cpu")
    assert harness_backend(1) == "gloo"
