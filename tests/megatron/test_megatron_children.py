"""The switch holds in the processes a program starts (NOTE [ Switch in every process ]).

Each case runs a fresh interpreter (tests/megatron/_switch_children.py's parent_main) that imports
megatron.core before pickling a tensor: megatron-core 0.19 replaces torch's storage unpickler
there, so unpickling that tensor imports megatron. A child must then still see this package's
modules under megatron's names.
"""

import os
import subprocess
import sys

import pytest

from megatron_core import megatron as switch

pytestmark = pytest.mark.skipif(
    switch.megatron_core_version() is None, reason="the [megatron] extra (megatron-core)"
)
HERE = os.path.dirname(os.path.abspath(__file__))
MCORE_019 = (switch.megatron_core_version() or "").startswith("0.19.")


def _run_parent(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != switch.SWITCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    code = f"import _switch_children as c; c.parent_main({mode!r})"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=480, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split(" ", 1) for line in result.stdout.splitlines() if " " in line]
    return {key: value for key, value in lines}


def test_spawn_and_forkserver_children_install_the_switch_before_unpickling():
    out = _run_parent("switch")
    # 0.19's trap is real here (and absent in 0.16.1, whose pickles name only torch).
    assert out["names-megatron"] == str(MCORE_019)
    for method in ("spawn", "forkserver"):
        assert out[method] == "([0.0, 1.0, 2.0, 3.0], True, True)", (method, out)


def test_without_the_switch_children_get_megatron_cores_own_modules():
    # The control: the same program without install() serves megatron-core's own modules, so
    # the test above can tell the difference.
    out = _run_parent("plain")
    assert out["spawn"] == "([0.0, 1.0, 2.0, 3.0], False, True)", out


def test_harness_ranks_unpickle_arguments_without_importing_megatron():
    # The harness pickles storages itself (testing/pickling.py): a rank body can still install
    # the switch after its arguments were unpickled, however the caller's torch pickles.
    out = _run_parent("harness")
    assert out["harness"] == "([0.0, 1.0, 2.0, 3.0], True)"
