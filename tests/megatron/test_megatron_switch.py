"""The megatron switch (megatron_core.megatron): what it serves, what it refuses, its plugin."""

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import types

import pytest

from megatron_core import megatron as switch
from megatron_core.errors import MegatronCoreError
from megatron_core.testing import run_distributed

# Not API: availability flags of optional dependencies and module loggers.
NOT_API = {"HAVE_EINOPS", "HAVE_TE", "HAVE_DTENSOR", "IS_CHECKPOINTING", "HAVE_APEX", "logger"}


@pytest.mark.parametrize("version", ["0.16.1", "0.19.0", "0.19.2", "0.19.10"])
def test_tested_releases_are_accepted(version):
    assert switch.check_version(version) == version


@pytest.mark.parametrize("version", ["0.16.0", "0.17.0", "0.18.1", "0.20.0", "0.19rc1", "1.0.0"])
def test_untested_releases_are_refused_with_the_override_named(version, monkeypatch):
    monkeypatch.delenv(switch.ANY_VERSION_ENV, raising=False)
    with pytest.raises(MegatronCoreError, match=rf"megatron-core {version} is not a tested"):
        switch.check_version(version)
    monkeypatch.setenv(switch.ANY_VERSION_ENV, "1")
    with pytest.warns(UserWarning, match=switch.ANY_VERSION_ENV):
        assert switch.check_version(version) == version


def test_missing_megatron_core_names_the_extra(monkeypatch):
    monkeypatch.setattr(switch, "megatron_core_version", lambda: None)
    with pytest.raises(MegatronCoreError, match=r"\[megatron\]"):
        switch.install()
    assert not switch.is_installed()


@pytest.mark.requires_megatron_core
def test_install_after_megatron_was_imported_is_refused(monkeypatch):
    name = "megatron.core.parallel_state"
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))  # megatron-core's, imported
    with pytest.raises(MegatronCoreError, match=r"before megatron is imported.*parallel_state"):
        switch.install()
    assert not switch.is_installed()


def test_no_folder_of_tests_is_importable_as_an_optional_dependency():
    # pytest puts tests/ on sys.path (rootdir import mode, no __init__.py): a folder named like a
    # module megatron-core imports when present becomes a namespace package of that name, and
    # megatron-core imported in the test process then reads it as installed (no __version__, no
    # package metadata).
    tests = os.path.join(os.path.dirname(__file__), "..")
    optional = {"transformer_engine", "apex", "flash_attn", "einops", "deepspeed", "nvidia"}
    assert optional.isdisjoint(os.listdir(tests))


def test_served_table_is_megatron_names_onto_this_package():
    for name, target in switch.SERVED.items():
        assert name.startswith("megatron.core.") and target.startswith("megatron_core.")
        assert name.removeprefix("megatron.core.") == target.removeprefix("megatron_core.")


def test_the_guide_lists_exactly_the_served_modules():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    guide = open(os.path.join(root, "docs", "guides", "megatron-core-on-a-laptop.md")).read()
    section = guide.split("Served from this package:")[1].split("\n\n")[1]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("- `")}
    assert listed == set(switch.SERVED)


@pytest.mark.requires_megatron_core
def test_served_names_are_our_modules_and_nothing_else_is():
    report = run_distributed(_checks().served_report, 1, timeout=240)[0]
    assert all(report["identity"].values()), report["identity"]
    for name, missing in report["missing"].items():
        assert not set(missing) - NOT_API, (name, missing)  # a served module has every name
    unclaimed = report["unclaimed"]
    assert unclaimed["megatron.core.utils"].endswith(os.path.join("megatron", "core", "utils.py"))
    assert unclaimed["megatron.core.pipeline_parallel.combined_1f1b"].endswith("combined_1f1b.py")
    for private in (
        "megatron.core.tensor_parallel.recompute",
        "megatron.core.tensor_parallel._collectives",
        "megatron.core.parallel_state.state",
    ):
        assert unclaimed[private].startswith("ModuleNotFoundError"), private


def _checks():
    import _megatron_switch_checks

    return _megatron_switch_checks


@pytest.mark.requires_megatron_core
def test_pytest_plugin_runs_a_megatron_suite_on_gloo_with_one_flag(tmp_path):
    (tmp_path / "test_user_suite.py").write_text(
        textwrap.dedent(
            f"""
            import torch.distributed as dist
            from megatron.core import parallel_state
            import megatron_core

            def test_served_and_nccl_on_cpu_is_gloo():
                assert parallel_state is megatron_core.parallel_state
                dist.init_process_group(
                    backend="nccl", init_method="file://{tmp_path}/rendezvous",
                    world_size=1, rank=0,
                )
                parallel_state.initialize_model_parallel()
                assert parallel_state.get_tensor_model_parallel_world_size() == 1
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
            """
        )
    )
    plugins = importlib.metadata.entry_points(group="pytest11")
    load = [] if any(ep.name == "megatron_core_switch" for ep in plugins) else ["-p"]
    load += [] if not load else ["megatron_core.megatron.pytest_plugin"]
    env = {k: v for k, v in os.environ.items() if k != switch.SWITCH_ENV}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *load]
    result = subprocess.run(
        [*cmd, "--megatron-core-switch", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.requires_megatron_core
def test_python_m_runner_installs_the_switch_before_the_script(tmp_path):
    script = tmp_path / "user_script.py"
    (tmp_path / "beside.py").write_text("NAME = 'beside'\n")  # as python script.py finds it
    script.write_text(
        "import sys\n"
        "import beside\n"
        "from megatron.core import parallel_state\n"
        "print(parallel_state.__name__, sys.argv[1:], beside.NAME)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "megatron_core.megatron", str(script), "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "megatron_core.parallel_state ['--tp', '2'] beside"
    # A script in a Megatron-LM checkout, run from there: the installed megatron-core is the
    # megatron.core that runs (the checkout's would shadow it first on the path); the checkout
    # serves what no wheel ships.
    checkout = tmp_path / "Megatron-LM"
    for package in ("core", "checkout_only"):  # (0.19's wheel ships megatron.training too)
        (checkout / "megatron" / package).mkdir(parents=True)
        (checkout / "megatron" / package / "__init__.py").write_text("")
    (checkout / "pretrain.py").write_text(
        f"import megatron.core, megatron.checkout_only\nwhere = {str(checkout)!r}\n"
        "print(*(m.__file__.startswith(where) for m in (megatron.core, megatron.checkout_only)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "megatron_core.megatron", "pretrain.py"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=checkout,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "False True"


@pytest.mark.requires_megatron_core
def test_jit_fuser_compiles_at_first_call_not_at_import():
    # NOTE [ Without Transformer Engine ], rule 4: importing megatron-core applies torch.compile
    # to none of its jit_fuser functions (0.19 also calls torch.compile directly on one MoE
    # routing function, which is not jit_fuser's); the first call of one compiles it, once.
    script = textwrap.dedent(
        """
        import torch
        calls = []
        torch.compile = lambda fn=None, **options: calls.append((fn.__name__, options)) or fn
        from megatron_core import megatron as switch
        switch.install()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.fusions import fused_bias_gelu
        at_import = [name for name, _ in calls if name in vars(fused_bias_gelu)]
        before = len(calls)
        x, bias = torch.randn(4), torch.randn(4)
        out = [fused_bias_gelu.bias_gelu(bias, x) for _ in range(2)]
        expected = torch.nn.functional.gelu(x + bias, approximate="tanh")
        print(at_import, calls[before:], all(torch.allclose(o, expected, atol=1e-6) for o in out))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[] [('bias_gelu', {})] True", result.stdout


def test_check_megatron_lm_script_parses_and_names_a_missing_checkout(tmp_path):
    # scripts/checks/check_megatron_lm.sh runs Megatron-LM's pretrain_gpt.py from a user's checkout
    # (none in CI): here it must parse, and refuse a folder without the script, naming it.
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    script = os.path.join(root, "scripts", "checks", "check_megatron_lm.sh")
    assert subprocess.run(["bash", "-n", script], timeout=60).returncode == 0
    result = subprocess.run(
        ["bash", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and f"no pretrain_gpt.py in {tmp_path}" in result.stdout


@pytest.mark.parametrize("release, etp_rule", [("0.16.1", False), ("0.19.2", True)])
def test_expert_allreduce_rule_follows_the_served_release(release, etp_rule, monkeypatch):
    """0.16.1 marks expert parameters for the expert data-parallel group under expert
    parallelism only; 0.19 also where ETP != TP (tensor_parallel/linear/base.py)."""
    from megatron_core.tensor_parallel.linear import base as linear_base

    monkeypatch.setattr(switch, "megatron_core_version", lambda: release)
    monkeypatch.setattr(switch, "_foreign_imports", lambda: [])
    assert not switch.is_installed()
    try:
        switch.install(cuda_on_cpu=False)
        assert linear_base._EXPERT_GROUPS_WHEN_ETP_DIFFERS is etp_rule
    finally:
        switch.uninstall()
    assert linear_base._EXPERT_GROUPS_WHEN_ETP_DIFFERS is True
    assert not switch.is_installed()
