"""Stage predicates and rank lookups over a pipeline group (megatron-core's
``pipeline_parallel.utils``).

Every function takes the pipeline process group explicitly (or, for the virtual-stage predicates,
the virtual stage and size), so it works for any group, not only parallel_state's. A ``None``
group, or a process without torch.distributed, counts as a pipeline of one stage (rank 0 of 1),
as in megatron-core. The CUDA-stream helpers of megatron-core's module
(``ScheduleNode``, ``set_streams``, ``stream_acquire_context``, ...) belong to its combined-1F1B
machinery and are not provided.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.utils import make_viewless_tensor

__all__ = [
    "is_pp_first_stage",
    "is_pp_last_stage",
    "is_vp_first_stage",
    "is_vp_last_stage",
    "get_pp_first_rank",
    "get_pp_last_rank",
    "get_pp_next_rank",
    "get_pp_prev_rank",
    "make_viewless",
    "NoopScheduleNode",
    "AbstractSchedulePlan",
]


def _rank(group) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return group.rank()


def _size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return group.size()


def is_pp_first_stage(pp_group) -> bool:
    """True on the first stage of ``pp_group`` (its rank 0)."""
    return _rank(pp_group) == 0


def is_pp_last_stage(pp_group) -> bool:
    """True on the last stage of ``pp_group`` (its rank size - 1)."""
    return _rank(pp_group) == _size(pp_group) - 1


def _check_vp_stage(vp_stage: int | None, vp_size: int | None) -> bool:
    """True when there is no interleaving (then vp_stage must be None or 0)."""
    if vp_size is not None and vp_size > 1:
        return False
    if vp_stage not in (None, 0):
        raise MegatronCoreError(
            f"is_vp_first_stage / is_vp_last_stage: vp_stage ({vp_stage}) must be 0 or None "
            f"when vp_size ({vp_size}) is None or <= 1"
        )
    return True


def is_vp_first_stage(vp_stage: int | None, vp_size: int | None) -> bool:
    """True for model chunk 0 of ``vp_size`` (always, without interleaving)."""
    return _check_vp_stage(vp_stage, vp_size) or vp_stage == 0


def is_vp_last_stage(vp_stage: int | None, vp_size: int | None) -> bool:
    """True for the last model chunk (always, without interleaving)."""
    return _check_vp_stage(vp_stage, vp_size) or vp_stage == vp_size - 1


def get_pp_first_rank(pp_group) -> int:
    """Global rank of the first stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[0]


def get_pp_last_rank(pp_group) -> int:
    """Global rank of the last stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[-1]


def get_pp_next_rank(pp_group) -> int | None:
    """Global rank of the next stage, or None on the last stage (no wrap-around)."""
    if is_pp_last_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[_rank(pp_group) + 1]


def get_pp_prev_rank(pp_group) -> int | None:
    """Global rank of the previous stage, or None on the first stage (no wrap-around)."""
    if is_pp_first_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[_rank(pp_group) - 1]


def make_viewless(e: torch.Tensor) -> torch.Tensor:
    """``e`` itself when it is not a view; else a tensor with the same data and shape whose
    ``_base`` is None, still connected to ``e``'s graph (so deallocating it frees memory)."""
    return make_viewless_tensor(e, requires_grad=e.requires_grad, keep_graph=True)


class NoopScheduleNode:
    """A schedule node that passes its inputs through forward and its gradients backward."""

    def forward(self, inputs):
        """Return ``inputs`` unchanged."""
        return inputs

    def backward(self, outgrads):
        """Return ``outgrads`` unchanged."""
        return outgrads


class AbstractSchedulePlan(ABC):
    """The protocol a model's ``build_schedule_plan`` returns for combined 1F1B schedules."""

    @staticmethod
    @abstractmethod
    def run(
        f_schedule_plan,
        b_schedule_plan,
        grad=None,
        pre_forward=None,
        pre_backward=None,
        post_forward=None,
        post_backward=None,
    ):
        """Run one forward plan and one backward plan, calling the hooks around each."""
