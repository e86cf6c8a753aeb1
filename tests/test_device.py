"""device.py: type selection, backend, RNG round trip (single process)."""

import pytest
import torch

from megatron_core import device
from megatron_core.errors import MegatronCoreError


@pytest.fixture(autouse=True)
def _reset_device(monkeypatch):
    monkeypatch.delenv("MEGATRON_CORE_DEVICE", raising=False)
    device.set_device_type(None)
    yield
    device.set_device_type(None)


def test_cpu_by_default_with_gloo():
    assert device.device_type() == "cpu"
    assert device.default_backend() == "gloo"
    assert device.current_device() == torch.device("cpu")
    assert not device.is_accelerator()
    assert device.device_generator() is torch.default_generator
    device.synchronize()  # a no-op on cpu, must not touch torch.cuda
    assert device.memory_allocated() == 0 and device.max_memory_allocated() == 0


def test_unknown_device_type_is_refused_with_its_name(monkeypatch):
    with pytest.raises(MegatronCoreError, match=r"device type \('tpu'\) must be one of"):
        device.set_device_type("tpu")
    monkeypatch.setenv("MEGATRON_CORE_DEVICE", "xpu9")
    with pytest.raises(MegatronCoreError, match="MEGATRON_CORE_DEVICE='xpu9' is not one of cpu"):
        device.device_type()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(MegatronCoreError, match="torch.cuda.is_available"):
        device.set_device_type("cuda")


def test_rng_state_round_trip_replays_the_same_numbers():
    device.manual_seed(123)
    state = device.get_rng_state()
    first = torch.rand(5)
    device.set_rng_state(state)
    torch.testing.assert_close(torch.rand(5), first, rtol=0, atol=0)  # bitwise: same stream


def test_explicit_and_env_cpu_are_accepted(monkeypatch):
    device.set_device_type("cpu")
    assert device.device_type() == "cpu"
    device.set_device_type(None)
    monkeypatch.setenv("MEGATRON_CORE_DEVICE", "CPU")  # case-insensitive
    assert device.device_type() == "cpu" and device.default_backend() == "gloo"


def test_cpu_paths_never_touch_torch_cuda(monkeypatch):
    # A CPU-only torch build has no working torch.cuda: make every call into it fail loudly.
    def refuse(*args, **kwargs):
        raise AssertionError("torch.cuda was touched on the cpu device type")

    for name in (
        "is_available",
        "current_device",
        "set_device",
        "device_count",
        "get_rng_state",
        "set_rng_state",
        "manual_seed",
        "synchronize",
        "memory_allocated",
        "max_memory_allocated",
        "reset_peak_memory_stats",
    ):
        monkeypatch.setattr(torch.cuda, name, refuse)
    device.set_device_type("cpu")
    assert device.current_device() == torch.device("cpu")
    device.set_current_device(3)
    state = device.get_rng_state()
    device.manual_seed(7)
    device.set_rng_state(state)
    assert device.device_generator() is torch.default_generator
    device.synchronize()
    device.reset_peak_memory_stats()
    assert device.memory_allocated() == 0 and device.max_memory_allocated() == 0
    device.allocated_bytes()  # the census: no torch.cuda either
    with device.StepTimer():
        pass


def test_the_cpu_census_counts_each_allocator_storage_once():
    # NOTE [ The allocator's total on the CPU ]: views share their storage, numpy's memory is
    # not the allocator's, a leaf's gradient (held by C++ until read) is counted
    import numpy

    before = device.allocated_bytes()
    block = torch.ones(1000)
    views = [block[10:], block.view(10, 100)]
    wrapped = torch.from_numpy(numpy.zeros(5000, dtype=numpy.float32))
    assert device.allocated_bytes() - before == 4000, (views, wrapped)
    weight = torch.ones(250, requires_grad=True)
    (weight * 2).sum().backward()
    assert device.allocated_bytes() - before == 4000 + 1000 + 1000  # the weight and its grad


def test_the_step_timer_counts_work_not_waiting():
    # NOTE [ Recompute planner ], rule 2: on the CPU the planner's clock is this thread's CPU
    # time, which another process holding the core does not move; a wait is not work
    import time

    with device.StepTimer() as waited:
        time.sleep(0.2)
    with device.StepTimer() as worked:
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
    assert waited.ms < 50, waited.ms
    assert worked.ms >= 100, worked.ms


_FAULTS = """
import json, resource, torch
from megatron_core import device

def faults(n):  # minor page faults of making and freeing a 40 MiB CPU tensor, n times
    out = []
    for _ in range(n):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        block = torch.ones(10 << 20)
        del block
        out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return out

print(json.dumps([faults(3), device.keep_freed_host_memory(), faults(4)]))
"""


def test_kept_host_memory_is_not_faulted_in_again():
    # a 40 MiB block is above glibc's largest dynamic mmap threshold (32 MiB): by default each
    # one is an mmap of its own, returned at its free and faulted in again; kept, the heap
    # serves it again after the first one or two. A process of its own: the setting is for
    # the process
    import ctypes
    import json
    import os
    import subprocess
    import sys

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError, TypeError):
        pytest.skip("the C library is not glibc")
    tuned = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    env = {k: v for k, v in os.environ.items() if k not in tuned}  # glibc's defaults
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS], capture_output=True, text=True, env=env
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    before, took, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert took is True
    # 40 MiB is 10,240 pages of 4 KiB, or 20 huge pages of 2 MiB where the kernel gives those
    assert min(before) >= 10, before
    assert max(after[2:]) * 10 <= min(before), (before, after)
