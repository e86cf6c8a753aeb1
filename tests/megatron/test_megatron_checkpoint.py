"""megatron-core's dist_checkpointing over this core's layers (sharded_state_dict), via the switch.

megatron-core's own GPTModel is saved at tp = 2 with ``dist_checkpointing.save`` and loaded with
``dist_checkpointing.load`` at tp = 1 and tp = 4 into a model initialized from another seed: the
loaded parameters equal the saved ones exactly (a checkpoint moves bits, it does no arithmetic).
"""

import pytest

from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed

if megatron_core_version() is None:
    pytest.skip("megatron-core is not installed (the [megatron] extra)", allow_module_level=True)

# megatron-core's checkpoint writer needs psutil without declaring it; without it the save
# hangs instead of failing (docs/guides/megatron-core-on-a-laptop.md). The [megatron] extra
# installs it.
pytest.importorskip("psutil", reason="megatron-core's dist_checkpointing writer needs psutil")

from _megatron_gpt import Run, initial_state, load_checkpoint, save_checkpoint  # noqa: E402

TIMEOUT = 120


def test_saved_at_tp2_loads_at_tp1_and_tp4(tmp_path):
    start = run_distributed(initial_state, 1, Run(), timeout=TIMEOUT)[0]
    directory = str(tmp_path)  # megatron-core saves into an existing, empty directory
    saved = run_distributed(save_checkpoint, 2, Run(tp=2), start, directory, timeout=TIMEOUT)[0]
    assert saved.keys() == start.keys()
    for tp in (1, 4):
        loaded = run_distributed(load_checkpoint, tp, Run(tp=tp), directory, timeout=TIMEOUT)
        for name, param in saved.items():
            assert loaded[0][name].equal(param), f"tp={tp}: {name}"


def test_moe_saved_at_ep2_loads_at_ep1(tmp_path):
    """megatron-core's SequentialMLP places each local expert at its global index through
    ``sharded_offsets``, which this package's expert layers prepend to their TP axis."""
    start = run_distributed(initial_state, 1, Run(moe=True), timeout=TIMEOUT)[0]
    directory = str(tmp_path)
    run_distributed(save_checkpoint, 2, Run(moe=True, ep=2), start, directory, timeout=TIMEOUT)
    loaded = run_distributed(load_checkpoint, 1, Run(moe=True), directory, timeout=TIMEOUT)[0]
    assert loaded.keys() == start.keys()
    for name, param in start.items():
        assert loaded[name].equal(param), name
