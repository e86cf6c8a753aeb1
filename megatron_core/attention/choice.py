"""Which kernel an attention call runs, and the log line that names a fallback (NOTE [ Fused
attention ], rule 2)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch.distributed as dist

from megatron_core import flags
from megatron_core.errors import MegatronCoreError

__all__ = ["ATTENTION_BACKENDS", "KernelChoice", "check_backend", "report", "kernels_used"]

# "auto": torch's fused kernels where the inputs allow, else the unfused computation (named in
# the log); "fused": the fused kernels or an error naming why not; "unfused": the computation
# that materializes the scores (megatron-core's --attention-backend spelling where it fits)
ATTENTION_BACKENDS = ("auto", "fused", "unfused")

logger = logging.getLogger("megatron_core.attention")

_REPORTED: set[tuple] = set()
_USED: Counter = Counter()


@dataclass(frozen=True)
class KernelChoice:
    """What one attention call runs.

    Attributes:
        kernel: the fused kernel ("flash", "efficient", "cudnn", "flash_cpu", ...) or
            "unfused".
        reason: why the call is unfused (None when it is fused, or asked unfused by name).
    """

    kernel: str
    reason: str | None = None

    @property
    def fused(self) -> bool:
        """Whether the call runs a fused kernel (no [sq, sk] score matrix kept)."""
        return self.kernel != "unfused"


def check_backend(backend: str, where: str) -> str:
    """``backend`` (a string, or an enum whose name is one) lower-cased, if it is one of
    :data:`ATTENTION_BACKENDS`.

    Raises:
        MegatronCoreError: any other value, naming it and ``where``.
    """
    name = getattr(backend, "name", backend)
    if not isinstance(name, str) or name.lower() not in ATTENTION_BACKENDS:
        raise MegatronCoreError(
            f"{where}: attention backend ({backend!r}) must be one of {ATTENTION_BACKENDS}"
        )
    return name.lower()


def _first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def report(where: str, choice: KernelChoice, backend: str, detail: str) -> KernelChoice:
    """Count ``choice`` and log it once: a fallback of the "auto" backend always (once per
    place and reason, at WARNING, on global rank 0), every distinct choice on every rank when
    ``MEGATRON_CORE_ATTENTION_DEBUG`` is on. ``detail`` describes the inputs (dtype, device,
    dropout, masks) for the line.

    Raises:
        MegatronCoreError: ``backend`` is "fused" and the choice is not.
    """
    if backend == "fused" and not choice.fused:
        raise MegatronCoreError(
            f"{where}: the fused attention backend was asked for, but {choice.reason} ({detail})"
        )
    _USED[(where, choice.kernel)] += 1
    debug = flags.flag("MEGATRON_CORE_ATTENTION_DEBUG")
    if choice.reason is not None and backend == "auto" and not debug:
        key = (where, choice.reason)
        if key not in _REPORTED and _first_rank():
            _REPORTED.add(key)
            logger.warning("%s runs the unfused attention: %s (%s)", where, choice.reason, detail)
    elif debug:
        key = (where, choice.kernel, detail)
        if key not in _REPORTED:
            _REPORTED.add(key)
            why = f": {choice.reason}" if choice.reason else ""
            logger.warning(
                "%s runs the %s attention kernel%s (%s)", where, choice.kernel, why, detail
            )
    return choice


def kernels_used(reset: bool = False) -> dict[tuple[str, str], int]:
    """How many attention calls ran each kernel in this process so far, by (place, kernel);
    with ``reset`` the counts start again from zero after they are returned."""
    used = dict(_USED)
    if reset:
        _USED.clear()
    return used
