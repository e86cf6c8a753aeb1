"""The pytest plugin runs a suite written like megatron-core's own unit tests, unmodified:
``torchrun --nproc-per-node N -m pytest --megatron-core-switch ...`` on a CPU-only torch.

The suite below does in its own words what Megatron-LM's ``tests/unit_tests/conftest.py`` and
``test_utilities.Utils`` do: ask ``is_te_min_version("1.3")`` before every test (megatron-core
0.16.1 raises TypeError without Transformer Engine; with the switch the Transformer Engine
stand-in answers) and pick a device with ``set_device(rank % device_count())``
(ZeroDivisionError with torch's device_count() of 0; NOTE [ CUDA on the CPU ], rule 5).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_core.megatron import SWITCH_ENV, cpu_mode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [
    pytest.mark.requires_megatron_core,
    pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU-only torch"),
]

CONFTEST = """
    import os
    import pytest
    from megatron.core.utils import is_te_min_version

    @pytest.fixture(autouse=True)
    def flash_attention_off():
        if is_te_min_version("1.3"):  # megatron-core's own raises without Transformer Engine
            os.environ["NVTE_FLASH_ATTN"] = "0"
"""

SUITE = """
    import os
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    import megatron_core

    def test_cuda_set_up_on_cpu_ranks():
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank % torch.cuda.device_count())
        assert torch.cuda.device_count() == int(os.environ["LOCAL_WORLD_SIZE"]) == 2
        assert not torch.cuda.is_available()
        dist.init_process_group(backend="nccl")
        assert dist.get_backend() == "gloo"
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        assert parallel_state is megatron_core.parallel_state
        total = torch.ones(1).cuda() * rank
        dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
        assert total.item() == 1.0
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
"""


def _environment() -> dict:
    unset = (SWITCH_ENV, cpu_mode.ENV, "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    environ["PYTHONPATH"] = os.pathsep.join([ROOT, environ.get("PYTHONPATH", "")])
    return environ


def test_a_megatron_style_suite_runs_under_torchrun_with_one_flag(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "pytest", "--megatron-core-switch", "-q"]
    command += ["-p", "no:cacheprovider", str(tmp_path)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=_environment(), cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert result.stdout.count("1 passed") == 2, result.stdout[-3000:]


def test_version_questions_are_answered_and_put_back():
    # megatron-core's unit-test conftest asks is_te_min_version before every test, and
    # tests/unit_tests/models/test_gpt_model.py asks is_fa_min_version at collection time; without
    # the libraries megatron-core's own raise (0.16.1: TypeError / ModuleNotFoundError). With the
    # switch the Transformer Engine stand-in answers the first (its version, 2.11.0) and the
    # adapter of NOTE [ Without Transformer Engine ], rule 8, the second; the plugin puts it back.
    code = """
        import json, warnings
        warnings.simplefilter("ignore")
        from types import SimpleNamespace
        from megatron_core.megatron import pytest_plugin

        config = SimpleNamespace(known_args_namespace=SimpleNamespace(megatron_core_switch=True))
        pytest_plugin.pytest_load_initial_conftests(config, None, [])
        import megatron.core.utils as utils
        original = utils.is_fa_min_version.__wrapped__
        try:
            original("2.7.3")
            raised = None
        except ModuleNotFoundError as error:
            raised = type(error).__name__
        answered = [utils.is_te_min_version("1.3"), utils.is_te_min_version("2.12"),
                    utils.is_fa_min_version("2.7.3")]
        pytest_plugin.pytest_unconfigure(config)
        print(json.dumps([raised, answered, utils.is_fa_min_version is original]))
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env=_environment(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    raised, answered, restored = json.loads(result.stdout.strip().splitlines()[-1])
    assert raised == "ModuleNotFoundError"  # megatron-core's own, without flash-attn
    assert answered == [True, False, False] and restored


OUT_OF_STEP = """
    import os
    import torch.distributed as dist

    def test_fails_on_one_rank_before_a_barrier():
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl")
        assert int(os.environ["RANK"]) != 1, "rank 1 fails alone"
        dist.barrier()  # rank 0 waits here for a barrier rank 1 never reaches

    def test_after_it():
        dist.barrier()
"""


def test_a_test_failing_on_one_rank_ends_the_session_instead_of_hanging_it(tmp_path):
    # NOTE [ Ranks out of step in a test session ]: without the step after each test, rank 1
    # would pair its next barrier with rank 0's and the session would wait in gloo forever.
    (tmp_path / "test_out_of_step.py").write_text(textwrap.dedent(OUT_OF_STEP))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "pytest", "--megatron-core-switch", "-q"]
    command += ["--megatron-core-step-timeout", "5", "-p", "no:cacheprovider", str(tmp_path)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=_environment(), cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-6000:]
    assert "rank(s) [0] did not finish test 1 of the session within 5 s" in output, output[-6000:]
    assert "rank 1 fails alone" in output  # the failure the session's summary would have shown
    assert "test_after_it" not in output.replace("test_out_of_step.py::test_after_it", "")
