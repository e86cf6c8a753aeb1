"""The multi-rank harness: results per rank, failures and hangs surface, pools are reused."""

import os
import pickle
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import (
    DistributedTestError,
    DistributedTestTimeout,
    distributed_test,
    run_distributed,
)
from megatron_core.testing.pools import _worker_pids
from megatron_core.testing.worker import harness_backend, harness_device_type


def _rank_world_and_sum(offset, scale=1.0):
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), x.item() * scale + offset


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_each_ranks_value(world_size):
    results = run_distributed(_rank_world_and_sum, world_size, 10.0, scale=2.0)
    total = 2.0 * sum(range(world_size)) + 10.0
    assert results == [(rank, world_size, total) for rank in range(world_size)]


def _start_state():
    """What a rank sees when the function starts; then it dirties the state for the next call."""
    seen = {
        "env": tuple(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "parallel_state": parallel_state.model_parallel_is_initialized(),
        "device": device.device_type(),
        "random": torch.rand(3),
        "pid": os.getpid(),
    }
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    torch.set_num_threads(2)
    torch.manual_seed(dist.get_rank() + 99)
    return seen


def test_every_call_starts_from_the_same_state_and_reuses_the_workers():
    first = run_distributed(_start_state, 2)
    second = run_distributed(_start_state, 2)  # after the first call dirtied every rank
    assert _worker_pids(2) == [seen["pid"] for seen in first]
    for rank in range(2):
        a, b = first[rank], second[rank]
        assert a["pid"] == b["pid"]  # the warm pool served both calls
        assert a["env"] == (str(rank), "2", str(rank))
        assert (a["backend"], a["threads"], a["parallel_state"], a["device"]) == (
            harness_backend(2),
            1,
            False,
            harness_device_type(),
        )
        assert {k: v for k, v in a.items() if k != "random"} == {
            k: v for k, v in b.items() if k != "random"
        }
        torch.testing.assert_close(a["random"], b["random"], rtol=0, atol=0)  # same seed: bitwise


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        value = 41
        assert value == 42, "rank one disagrees"
    dist.barrier()  # rank 0 blocks here forever: rank 1 never arrives
    return "unreachable on a failing run"


def test_failing_rank_reaches_pytest_with_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_1, 2, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1: AssertionError: rank one disagrees" in message
    assert 'assert value == 42, "rank one disagrees"' in message  # the remote source line
    assert "_fail_on_rank_1" in message and "Traceback" in message
    assert "rank(s) [0] had not finished" in message  # blocked in the barrier, then killed
    assert not isinstance(info.value, DistributedTestTimeout)
    assert isinstance(info.value, MegatronCoreError)
    assert set(info.value.failures) == {1}
    assert isinstance(info.value.failures[1].exception, AssertionError)
    assert elapsed < 20, elapsed  # a 2 s grace, not the 60 s timeout
    assert _worker_pids(2) is None  # the failed pool was discarded


def _return_pid_or_hang():
    if dist.get_rank() == 1:
        time.sleep(60)
    return os.getpid()


def test_hanging_rank_is_killed_at_the_timeout():
    pids = [pid for _, pid in run_distributed(_rank_world_and_pid, 2)]
    start = time.monotonic()
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(_return_pid_or_hang, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 15, elapsed
    message = str(info.value)
    assert "timed out after 3 s" in message and "rank(s) [1]" in message
    assert _worker_pids(2) is None
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped: not even a zombie is left
            os.kill(pid, 0)
    # The next call gets a fresh pool and works.
    assert [r[0] for r in run_distributed(_rank_world_and_pid, 2)] == [0, 1]


def _rank_world_and_pid():
    return dist.get_rank(), os.getpid()


def test_pool_is_reused_across_calls():
    first = run_distributed(_rank_world_and_pid, 4)
    second = run_distributed(_rank_world_and_pid, 4)
    assert first == second
    assert _worker_pids(4) == [pid for _, pid in first]
    assert os.getpid() not in _worker_pids(4)


def _tensor_results(n):
    return [torch.full((n,), float(dist.get_rank())) for _ in range(200)]


def test_tensor_results_come_back_by_value():
    # 200 tensors per rank: shared-memory reductions would pass file descriptors for each.
    per_rank = run_distributed(_tensor_results, 2, 5)
    for rank, tensors in enumerate(per_rank):
        assert len(tensors) == 200
        torch.testing.assert_close(tensors[-1], torch.full((5,), float(rank)))


@pytest.mark.parametrize("world_size", [0, -1, 1.5, "2", True, None])
def test_bad_world_size_raises_before_spawning(world_size):
    with pytest.raises(MegatronCoreError, match=rf"world_size \({world_size!r}\) must be"):
        run_distributed(_rank_world_and_pid, world_size)


def test_unpicklable_function_or_argument_raises_before_spawning():
    with pytest.raises(MegatronCoreError, match="must be picklable") as info:
        run_distributed(lambda: 1, 2)
    assert "<lambda>" in str(info.value)
    with pytest.raises(MegatronCoreError, match="arguments for _rank_world_and_sum"):
        run_distributed(_rank_world_and_sum, 2, lambda: 1)
    with pytest.raises(MegatronCoreError, match=r"timeout \(0\) must be"):
        run_distributed(_rank_world_and_pid, 2, timeout=0)


def _unpicklable_result():
    return lambda: None


def test_unpicklable_result_is_reported():
    with pytest.raises(DistributedTestError, match=r"rank 0: .*(Pickl|pickle)"):
        run_distributed(_unpicklable_result, 1)


def test_fixture_is_run_distributed(distributed):
    assert distributed is run_distributed
    assert distributed(_rank_world_and_sum, 2, 1.0) == [(0, 2, 2.0), (1, 2, 2.0)]


@distributed_test(world_sizes=(1, 2))
def test_decorated_body_runs_on_every_rank():
    """The decorated body runs on each rank; pytest parametrizes it by world size."""
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == dist.get_world_size()


def test_decorator_keeps_the_body_picklable():
    body = globals()["_distributed_body_test_decorated_body_runs_on_every_rank"]
    assert pickle.loads(pickle.dumps(body)) is body
    marks = test_decorated_body_runs_on_every_rank.pytestmark
    assert [m.args for m in marks] == [("world_size", (1, 2))]
    with pytest.raises(MegatronCoreError, match="must not be empty"):
        distributed_test(world_sizes=())


def test_module_imported_after_the_pool_started(tmp_path, monkeypatch):
    run_distributed(_rank_world_and_pid, 2)  # the pool exists before the module does
    (tmp_path / "late_module_for_harness.py").write_text(
        "import torch.distributed as dist\n\ndef body(x):\n    return x * (dist.get_rank() + 1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import late_module_for_harness

    assert run_distributed(late_module_for_harness.body, 2, 3) == [3, 6]


def test_live_workers_are_capped():
    run_distributed(_rank_world_and_pid, 4)
    run_distributed(_rank_world_and_pid, 8)  # 8 light processes on 2 cores are fine
    live = [size for size in range(1, 9) if _worker_pids(size) is not None]
    assert 8 in live and sum(live) <= 10, live


def test_no_reuse_env_gives_fresh_workers(monkeypatch):
    monkeypatch.setenv("MEGATRON_CORE_TEST_NO_REUSE", "1")
    first = run_distributed(_rank_world_and_pid, 2)
    assert _worker_pids(2) is None
    assert run_distributed(_rank_world_and_pid, 2) != first


def _destroy_world():
    dist.destroy_process_group()
    return os.getpid()


def test_failed_reset_discards_the_pool_with_a_warning():
    with pytest.warns(RuntimeWarning, match="default process group was destroyed"):
        run_distributed(_destroy_world, 1)
    assert _worker_pids(1) is None
    assert run_distributed(_rank_world_and_sum, 1, 0.0) == [(0, 1, 0.0)]


def _exit_on_rank_0():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def test_dead_worker_is_reported():
    with pytest.raises(DistributedTestError, match=r"rank 0: WorkerDied: .*exit code 3"):
        run_distributed(_exit_on_rank_0, 2, timeout=60)


_ORPHAN_SCRIPT = """
import sys, time
import torch.distributed as dist
from megatron_core.testing import run_distributed

def pid_then_hang():
    import os, time
    # One write of a short line is atomic on a pipe: the two ranks' lines never interleave.
    os.write(1, f"{os.getpid()}\\n".encode())
    if dist.get_rank() == 1:
        time.sleep(60)

if __name__ == "__main__":
    run_distributed(pid_then_hang, 2, timeout=60)
"""


def test_workers_exit_when_the_caller_dies(tmp_path):
    import signal
    import subprocess
    import sys

    script = tmp_path / "orphan_caller.py"
    script.write_text(_ORPHAN_SCRIPT)
    # A plain script, not pytest: the harness's CUDA mode would refuse its 2 ranks on 1 GPU.
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CORE_TEST_DEVICE"}
    caller = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    pids = [int(caller.stdout.readline()) for _ in range(2)]
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in pids if _is_alive(pid)]
    assert not alive, alive


def _is_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent counts as gone
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _import_megatron_unswitched():
    # What `import megatron.core.parallel_state` without the switch leaves behind: megatron-core's
    # own module under the claimed name (a stand-in here, so megatron-core need not be installed).
    sys.modules["megatron.core.parallel_state"] = types.ModuleType("megatron.core.parallel_state")
    return os.getpid()


def test_a_worker_that_imported_megatron_unswitched_is_not_reused():
    with pytest.warns(RuntimeWarning, match="megatron-core's own megatron.core.parallel_state"):
        (tainted,) = run_distributed(_import_megatron_unswitched, 1)
    assert run_distributed(os.getpid, 1) != [tainted]
