"""forward_step_calc_loss sets megatron-core's auxiliary-loss scales (MoE, MTP, and 0.19's
experimental attention variants such as DSA's indexer loss) as megatron-core does.

The scalers are megatron-core's classes, found in ``sys.modules`` (this package never imports
megatron-core): stand-in modules under their names record what they are given, so the test
runs without megatron-core, in one process (``cp_group_size`` and ``is_last_stage`` given).
"""

import sys
import types

import pytest
import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel.schedules import forward_step_calc_loss

MODULES = {
    "moe": ("megatron.core.transformer.moe.router", "MoEAuxLossAutoScaler"),
    "mtp": ("megatron.core.transformer.multi_token_prediction", "MTPLossAutoScaler"),
    "dsa": (
        "megatron.core.transformer.experimental_attention_variant.dsa",
        "DSAIndexerLossAutoScaler",
    ),
}


@pytest.fixture
def scalers(monkeypatch):
    """Stand-in scaler classes under megatron-core's module names; name -> list of scales set."""
    seen = {name: [] for name in MODULES}
    for name, (module_name, cls) in MODULES.items():
        module = types.ModuleType(module_name)
        scaler = type(cls, (), {"set_loss_scale": staticmethod(seen[name].append)})
        setattr(module, cls, scaler)
        monkeypatch.setitem(sys.modules, module_name, module)
    return seen


def _config(**options):
    base = {"calculate_per_token_loss": False, "grad_scale_func": lambda t: t * 3.0,
            "num_moe_experts": None, "mtp_num_layers": None, "timers": None}  # fmt: skip
    return types.SimpleNamespace(**{**base, **options})


def _run(config, output=None, loss_func=None):
    store = []
    output = torch.tensor(8.0) if output is None else output
    forward_step_calc_loss(None, output, loss_func, config, None, False, 2, store, 4, True)
    return store


def _values(scales):
    return [float(s.reshape(-1)[0]) for s in scales]


def test_dsa_indexer_scale_follows_cp_and_microbatches(scalers):
    def loss_func(out):
        return out.clone(), torch.tensor(4), {"loss": out.detach()}

    hook = []
    for per_token in (False, True):
        config = _config(
            calculate_per_token_loss=per_token,
            experimental_attention_variant_loss_scale_func=hook.append,
        )
        _run(config, loss_func=loss_func)
    assert _values(hook) == [3.0 * 4 / 2, 3.0]  # x cp / microbatches, or per token as it is
    # The variant's own scaler when only the variant is named; the config is not changed.
    config = _config(experimental_attention_variant="dsa", calculate_per_token_loss=True,
                     experimental_attention_variant_loss_scale_func=None)  # fmt: skip
    _run(config)
    assert _values(scalers["dsa"]) == [3.0]
    assert config.experimental_attention_variant_loss_scale_func is None
    # A dict of outputs (0.19) is stored as it is, and still scales.
    store = _run(_config(experimental_attention_variant="dsa", calculate_per_token_loss=True),
                 output={"loss": torch.tensor(8.0)})  # fmt: skip
    assert store[0]["loss"].item() == 8.0 and _values(scalers["dsa"]) == [3.0, 3.0]


def test_moe_and_mtp_scales_with_their_own_functions(scalers):
    _run(_config(num_moe_experts=4, mtp_num_layers=1))
    assert _values(scalers["moe"]) == [3.0 * 4 / 2] and _values(scalers["mtp"]) == [3.0 / 2]
    _run(_config(num_moe_experts=4, mtp_num_layers=1, moe_grad_scale_func=lambda: 10.0,
                 mtp_grad_scale_func=lambda: torch.tensor([6.0])))  # fmt: skip
    assert _values(scalers["moe"])[-1] == 10.0 * 4 / 2 and _values(scalers["mtp"])[-1] == 3.0
    assert not scalers["dsa"]  # no variant named: its scaler is left alone
    with pytest.raises(MegatronCoreError, match="moe_grad_scale_func"):
        _run(_config(num_moe_experts=4, moe_grad_scale_func=lambda: torch.ones(2)))
