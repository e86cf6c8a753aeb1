"""The one refusal of generalized tensor parallelism (megatron-core 0.19's weight remat).

megatron-core 0.19 adds generalized tensor parallelism: each weight is sharded a second time over
a "gtp remat" group and re-gathered (rematerialized) around every use. This package accepts every
0.19 option that names it, and a size of 1 (no remat, megatron-core's default) behaves as 0.19
does; a size above 1 raises :class:`ConfigError` from :func:`check_gtp_size`, naming the option,
before any collective runs.
"""

from __future__ import annotations

from megatron_core.errors import ConfigError

__all__ = ["check_gtp_size"]


def check_gtp_size(option: str, value) -> None:
    """Raise unless ``value`` is 1 (generalized TP off); ``option`` names the argument.

    Raises:
        ConfigError: ``value`` is not 1, e.g. ``gtp_remat_size (2) > 1: generalized tensor
            parallelism ... is not implemented``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{option} ({value!r}) must be a positive int (1: no weight remat)")
    if value != 1:
        raise ConfigError(
            f"{option} ({value}) > 1: generalized tensor parallelism (megatron-core 0.19's "
            "weight rematerialization) is not implemented in megatron_core; use 1"
        )
