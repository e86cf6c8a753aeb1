"""The switch serves the Transformer Engine stand-in as ``transformer_engine`` (NOTE [ Serving
the Transformer Engine stand-in ]): only where no real Transformer Engine is importable, as the
same module objects, with megatron-core's flags agreeing; ``uninstall()`` takes it away; a real
one (here a minimal package put on the path) always wins; without the switch nothing changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_core.testing import run_distributed

pytestmark = pytest.mark.requires_megatron_core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def served_report() -> dict:
    """Run on a worker with the switch installed: what ``transformer_engine`` resolves to."""
    import importlib
    import pickle

    from megatron_core import megatron as switch

    switch.install()
    import transformer_engine

    import megatron_core.transformer_engine as stand_in

    report = {
        "same object": transformer_engine is stand_in,
        "submodule": importlib.import_module("transformer_engine.pytorch.module.linear")
        is importlib.import_module("megatron_core.transformer_engine.pytorch.module.linear"),
        "version": transformer_engine.__version__,
    }
    try:
        importlib.import_module("transformer_engine.pytorch.permutation")
        report["absent module"] = "imported"
    except ModuleNotFoundError as exc:
        report["absent module"] = f"ModuleNotFoundError: {exc}"
    from megatron.core import utils
    from megatron.core.extensions import transformer_engine as extension
    from megatron.core.tensor_parallel import random

    report["megatron HAVE_TE"] = extension.HAVE_TE
    report["random HAVE_TE"] = random.HAVE_TE
    report["min 2.11"] = utils.is_te_min_version("2.11.0")
    report["min 2.12"] = utils.is_te_min_version("2.12.0")
    # A real Transformer Engine's pickled recipe names transformer_engine.common.recipe.
    ours = pickle.dumps(stand_in.common.recipe.DelayedScaling(margin=2), protocol=2)
    theirs = ours.replace(
        b"megatron_core.transformer_engine.common.recipe", b"transformer_engine.common.recipe"
    )
    recipe = pickle.loads(theirs)
    report["recipe"] = (type(recipe) is stand_in.common.recipe.DelayedScaling, recipe.margin)
    # megatron-core's --te-rng-tracker: Transformer Engine's tracker, here the stand-in's
    random.model_parallel_cuda_manual_seed(1, te_rng_tracker=True, force_reset_rng=True, tp_rank=0)
    tracker = random.get_cuda_rng_tracker()
    report["te tracker"] = isinstance(tracker, stand_in.pytorch.distributed.CudaRNGStatesTracker)
    random.model_parallel_cuda_manual_seed(1, force_reset_rng=True, tp_rank=0)
    return report


def test_the_switch_serves_the_stand_in_as_transformer_engine():
    report = run_distributed(served_report, 1, timeout=240)[0]
    assert report["same object"] and report["submodule"]
    assert report["version"] == "2.11.0"
    assert report["absent module"].startswith("ModuleNotFoundError"), report["absent module"]
    assert report["megatron HAVE_TE"] is True and report["random HAVE_TE"] is True
    assert report["min 2.11"] is True and report["min 2.12"] is False
    assert report["recipe"] == (True, 2)
    assert report["te tracker"]


def _python(code: str, pythonpath: str = "") -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, ROOT) if p)}
    env.pop("MEGATRON_CORE_SWITCH", None)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_real_transformer_engine_always_wins(tmp_path):
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "9.9.9"\n')
    out = _python(
        """
        import warnings
        warnings.simplefilter("ignore")
        from megatron_core import megatron as switch
        from megatron_core.megatron import te_stand_in
        switch.install()
        import transformer_engine
        print(transformer_engine.__version__, te_stand_in.is_served())
        """,
        str(tmp_path),
    )
    assert out.split() == ["9.9.9", "False"]


def test_uninstall_takes_it_away_and_nothing_changes_without_the_switch():
    out = _python(
        """
        import importlib, warnings
        warnings.simplefilter("ignore")
        from megatron_core import megatron as switch
        from megatron_core.tensor_parallel import random

        def importable():
            try:
                importlib.import_module("transformer_engine")
                return True
            except ModuleNotFoundError:
                return False

        print(importable(), random.HAVE_TE)
        switch.install()
        print(importable(), random.HAVE_TE)
        switch.uninstall()
        print(importable(), random.HAVE_TE)
        """
    )
    assert out.split() == ["False", "False", "True", "True", "False", "False"]
