"""megatron-core's dist_checkpointing of a Transformer Engine-spec GPTModel on the stand-in.

Saved at TP 2 (and MoE at EP 2) with ``dist_checkpointing.save``; loaded with
``dist_checkpointing.load`` and a strict ``load_state_dict`` at TP 1 and 2 (EP 1) into a model
initialized from another seed: the parameters equal the saved ones exactly (a checkpoint moves
bits). The checkpoint holds Transformer Engine's entries: each module's ``_extra_state`` (empty
uint8 tensors, as a bf16 GPU run with Transformer Engine writes them) and, for one module, FP8
metadata in Transformer Engine's format, which loads and is kept byte for byte.
"""

import dataclasses

import pytest

from megatron_core.megatron import megatron_core_version
from megatron_core.testing import run_distributed

if megatron_core_version() is None:
    pytest.skip("megatron-core is not installed (the [megatron] extra)", allow_module_level=True)
pytest.importorskip("psutil", reason="megatron-core's dist_checkpointing writer needs psutil")

from _megatron_te_gpt import TeRun, initial_state, load_checkpoint, save_checkpoint  # noqa: E402

TIMEOUT = 240


@pytest.mark.parametrize("moe", [False, True])
def test_te_spec_checkpoint_loads_at_another_parallel_size(tmp_path, moe):
    start = run_distributed(initial_state, 1, TeRun(moe=moe), timeout=TIMEOUT)[0]
    directory = str(tmp_path)
    saving = TeRun(moe=moe, ep=2) if moe else TeRun(tp=2, sp=True)
    saving_ranks = run_distributed(save_checkpoint, 2, saving, start, directory, timeout=TIMEOUT)
    saved = saving_ranks[0]
    saved_params = {n: p for rank in saving_ranks for n, p in rank["params"].items()}
    assert saved_params.keys() == start.keys()
    extra = saved["extra"]
    assert "decoder.final_layernorm._extra_state" in extra
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state" in extra
    assert not [k for k in extra if "core_attention" in k]  # megatron-core leaves it out
    for tp in (1,) if moe else (1, 2):
        loading = dataclasses.replace(saving, tp=tp, sp=saving.sp and tp > 1, ep=1)
        loaded = run_distributed(load_checkpoint, tp, loading,
                                 directory, timeout=TIMEOUT)  # fmt: skip
        assert loaded[0]["other extra states empty"]
        assert saved["fp8 state"].numel() > 0 and loaded[0]["fp8 state"].equal(saved["fp8 state"])
        merged = {n: p for rank in loaded for n, p in rank["params"].items()}
        assert merged.keys() == saved_params.keys()
        for name, param in saved_params.items():
            assert merged[name].equal(param), f"tp={tp}: {name}"
