"""The "activation_checkpointing" section of a DeepSpeed config, and the checks of configure()'s
settings (NOTE [ DeepSpeed checkpointing ], rule 1, in __init__.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from megatron_core.errors import MegatronCoreError

__all__ = ["CONFIG_SECTION", "CONFIG_KEYS", "read_config", "check_settings", "check_mpu"]

# key -> (configure() argument, DeepSpeed's default).
CONFIG_SECTION = "activation_checkpointing"
CONFIG_KEYS = {
    "partition_activations": ("partition_activations", False),
    "contiguous_memory_optimization": ("contiguous_checkpointing", False),
    "cpu_checkpointing": ("checkpoint_in_cpu", False),
    "number_checkpoints": ("num_checkpoints", None),
    "synchronize_checkpoint_boundary": ("synchronize", False),
    "profile": ("profile", False),
}


def read_config(deepspeed_config: Any) -> dict[str, Any]:
    """The configure() arguments a DeepSpeed config (dict or JSON path) sets, with defaults."""
    if isinstance(deepspeed_config, (str, os.PathLike)):
        try:
            with open(deepspeed_config) as f:
                deepspeed_config = json.load(f)
        except (OSError, ValueError) as e:
            raise MegatronCoreError(
                f"configure: cannot read the DeepSpeed config {str(deepspeed_config)!r}: {e}"
            ) from None
    if not isinstance(deepspeed_config, Mapping):
        raise MegatronCoreError(
            f"configure: deepspeed_config ({type(deepspeed_config).__name__}) must be a dict or "
            "the path of a JSON file"
        )
    section = deepspeed_config.get(CONFIG_SECTION, {})
    if not isinstance(section, Mapping):
        raise MegatronCoreError(
            f"configure: deepspeed_config[{CONFIG_SECTION!r}] ({section!r}) must be a dict"
        )
    unknown = sorted(set(section) - set(CONFIG_KEYS))
    if unknown:
        raise MegatronCoreError(
            f"configure: unknown key(s) {unknown} in deepspeed_config[{CONFIG_SECTION!r}]; "
            f"DeepSpeed's keys are {sorted(CONFIG_KEYS)}"
        )
    return {arg: section.get(key, default) for key, (arg, default) in CONFIG_KEYS.items()}


def check_settings(settings: dict[str, Any]) -> None:
    """Raise MegatronCoreError naming the first bad value of configure()'s settings."""
    for name, value in settings.items():
        if name == "num_checkpoints":
            ok = value is None or (type(value) is int and value > 0)
            if not ok:
                raise MegatronCoreError(
                    f"configure: num_checkpoints ({value!r}) must be a positive int or None"
                )
        elif not isinstance(value, bool):
            raise MegatronCoreError(f"configure: {name} ({value!r}) must be a bool")
    if settings["contiguous_checkpointing"] and not settings["partition_activations"]:
        raise MegatronCoreError(
            "configure: contiguous_checkpointing=True needs partition_activations=True (the "
            "buffers hold partitions), as in DeepSpeed"
        )
    if settings["contiguous_checkpointing"] and settings["num_checkpoints"] is None:
        raise MegatronCoreError(
            "configure: contiguous_checkpointing=True needs num_checkpoints (the number of "
            "buffers per argument), got None"
        )


def check_mpu(mpu_: Any) -> None:
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if all(hasattr(mpu_, prefix + s) for s in ("rank", "world_size", "group")):
            return
    raise MegatronCoreError(
        f"configure: mpu_ ({type(mpu_).__name__}) has neither get_tensor_model_parallel_rank/"
        "world_size/group nor get_model_parallel_rank/world_size/group (megatron_core."
        "parallel_state has both)"
    )
