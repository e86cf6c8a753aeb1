"""configure()'s settings (a frozen dataclass), the "activation_checkpointing" section of a
DeepSpeed config, and the checks (NOTE [ DeepSpeed checkpointing ], rule 1, in __init__.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from megatron_core.errors import MegatronCoreError

__all__ = [
    "Settings",
    "CONFIG_SECTION",
    "CONFIG_KEYS",
    "read_config",
    "check_settings",
    "check_mpu",
]


@dataclasses.dataclass(frozen=True)
class Settings:
    """DeepSpeed's activation-checkpointing settings, named as configure()'s arguments.

    The defaults are DeepSpeed's. configure() builds one and checks it (:func:`check_settings`);
    every checkpoint builds one from the module globals when its forward starts (rule 1), unchecked.

    Attributes:
        partition_activations: keep 1/tp of each floating argument per rank (rule 2).
        contiguous_checkpointing: copy the partitions into preallocated buffers (rule 4).
        checkpoint_in_cpu: keep the saved arguments on the CPU (rule 3).
        num_checkpoints: buffers per argument (the module global ``num_layers``).
        synchronize: synchronize the device around forward and backward (rule 5).
        profile: print forward and backward times on rank 0 (rule 5).
    """

    # In DeepSpeed's config-key order: check_settings names the first bad value in this order.
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    checkpoint_in_cpu: bool = False
    num_checkpoints: int | None = None
    synchronize: bool = False
    profile: bool = False


# DeepSpeed config key -> the Settings field it sets.
_FIELDS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "number_checkpoints": "num_checkpoints",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}
CONFIG_SECTION = "activation_checkpointing"
# key -> (configure() argument, DeepSpeed's default).
CONFIG_KEYS = {key: (name, getattr(Settings(), name)) for key, name in _FIELDS.items()}


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


def check_settings(settings: Settings) -> None:
    """Raise MegatronCoreError naming the first bad value of configure()'s settings."""
    for field in dataclasses.fields(settings):
        name, value = field.name, getattr(settings, field.name)
        if name == "num_checkpoints":
            ok = value is None or (type(value) is int and value > 0)
            if not ok:
                raise MegatronCoreError(
                    f"configure: num_checkpoints ({value!r}) must be a positive int or None"
                )
        elif not isinstance(value, bool):
            raise MegatronCoreError(f"configure: {name} ({value!r}) must be a bool")
    if settings.contiguous_checkpointing and not settings.partition_activations:
        raise MegatronCoreError(
            "configure: contiguous_checkpointing=True needs partition_activations=True (the "
            "buffers hold partitions), as in DeepSpeed"
        )
    if settings.contiguous_checkpointing and settings.num_checkpoints is None:
        raise MegatronCoreError(
            "configure: contiguous_checkpointing=True needs num_checkpoints (the number of "
            "buffers per argument), got None"
        )


def check_mpu(mpu_: Any) -> None:
    """Raise a MegatronCoreError unless ``mpu_`` has the tensor-parallel rank, world size and
    group getters, under megatron-core's names or DeepSpeed's older ``get_model_parallel_*``."""
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if all(hasattr(mpu_, prefix + s) for s in ("rank", "world_size", "group")):
            return
    raise MegatronCoreError(
        f"configure: mpu_ ({type(mpu_).__name__}) has neither get_tensor_model_parallel_rank/"
        "world_size/group nor get_model_parallel_rank/world_size/group (megatron_core."
        "parallel_state has both)"
    )
