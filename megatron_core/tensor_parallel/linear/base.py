"""What ColumnParallelLinear and RowParallelLinear (layers.py) share: the tensor-parallel group
and sizes, weight creation, the linear function (frozen weight, delayed weight gradient),
megatron-core's ``_extra_state`` and ``sharded_state_dict`` (private)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.layer_params import (
    _init_shard,
    _new_param,
    _resolve_tp_group,
    _sequence_parallel,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.linear.autograd import (
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron_core.tensor_parallel.linear.delayed_wgrad import WgradStore
from megatron_core.tensor_parallel.linear.frozen import linear_with_frozen_weight
from megatron_core.tensor_parallel.sharded_state import sharded_state_dict_of_layer

__all__: list[str] = []


def _default_extra_state(state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: a state dict without ``_extra_state`` (saved before it
    existed, or by plain torch code) still loads with ``strict=True``, as in megatron-core."""
    state_dict.setdefault(f"{prefix}_extra_state")


# Which expert parameters are marked ``allreduce = False`` (their gradients reduced over the
# expert data-parallel group instead of the data-parallel one): megatron-core 0.16.1 marks them
# under expert parallelism only; 0.19 also where the expert tensor-parallel size differs from
# the tensor-parallel size (the replicas of an expert shard then lie along the expert groups).
# 0.19's rule holds unless the megatron switch serves megatron-core 0.16.x, which selects
# 0.16.1's (``set_expert_grad_rule``).
_EXPERT_GROUPS_WHEN_ETP_DIFFERS = True


def set_expert_grad_rule(release: str) -> None:
    """Select the ``allreduce`` rule of expert parameters: ``"0.16"`` (expert parallelism only)
    or ``"0.19"`` (also expert tensor-parallel size != tensor-parallel size). Layers built
    afterwards follow it; built ones keep their marks."""
    if release not in ("0.16", "0.19"):
        raise MegatronCoreError(f"set_expert_grad_rule: release ({release!r}) is not 0.16 or 0.19")
    global _EXPERT_GROUPS_WHEN_ETP_DIFFERS
    _EXPERT_GROUPS_WHEN_ETP_DIFFERS = release == "0.19"


def reduces_over_expert_groups(config, is_expert: bool) -> bool:
    """Whether a layer's parameters are reduced over the expert data-parallel group (marked
    ``allreduce = False``), by the rule in force (see ``set_expert_grad_rule``)."""
    if not is_expert:
        return False
    if config.expert_model_parallel_size > 1:
        return True
    etp = getattr(config, "expert_tensor_parallel_size", None)
    return (
        _EXPERT_GROUPS_WHEN_ETP_DIFFERS
        and etp is not None
        and etp != config.tensor_model_parallel_size
    )


class _ParallelLinearBase(torch.nn.Module):
    """What both parallel linear layers share: group, sizes, weight creation, bias flags."""

    _TP_AXES: dict[str, int] = {}  # state-dict name -> axis split over TP (sharded_state_dict)

    def _setup(self, layer, config, tp_group, is_expert, stride):
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.tp_group, self.tp_rank, self.tp_size = _resolve_tp_group(layer, tp_group, is_expert)
        # Expert layers leave their communication to the MoE token dispatcher (megatron-core).
        self.explicit_expert_comm = is_expert and (self.tp_size > 1 or self.expert_parallel)
        self.sequence_parallel = _sequence_parallel(layer, config, self.tp_size)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if not isinstance(stride, int) or stride < 1:
            raise MegatronCoreError(f"{layer}: stride ({stride!r}) must be an integer >= 1")
        self.gtp_remat_size = 1  # 0.19's weight remat: not implemented (check_gtp_size)
        self._wgrad_store = None  # NOTE [ Delayed weight gradient ] (linear/delayed_wgrad.py)
        if config.delay_wgrad_compute:
            if config.defer_embedding_wgrad_compute:
                raise MegatronCoreError(
                    f"{layer}: delay_wgrad_compute and defer_embedding_wgrad_compute (both True) "
                    "each postpone the weight gradient; choose one"
                )
            linear_sp = self.sequence_parallel and not self.explicit_expert_comm
            self._wgrad_store = WgradStore(self.tp_group, linear_sp and layer.startswith("Col"))

    def _make_weight(self, shape, partition_dim, init_method, stride, keep_master_weight):
        """Create, mark and initialize the weight shard; sets self.weight and self.master_weight."""
        config = self.config
        self.weight = _new_param(config, *shape)
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride)
        self.weight.allreduce = not reduces_over_expert_groups(config, self.is_expert)
        self.master_weight = _init_shard(
            self.weight,
            config,
            init_method,
            (self.output_size, self.input_size),
            partition_dim,
            stride,
            self.tp_rank,
            self.tp_size,
            keep_master_weight,
            self.is_expert,
        )

    def _forward_impl(self, input, weight, bias, fusion, **kwargs):
        """The linear function: the frozen-weight one when ``weight`` needs no gradient; with
        delay_wgrad_compute, one on the detached weight whose wgrad backward_dw computes."""
        if not weight.requires_grad:
            kwargs["grad_output_buffer"] = None
            kwargs["wgrad_deferral_limit"] = None
            return linear_with_frozen_weight(input, weight, bias, fusion, **kwargs)
        if self._wgrad_store is not None:  # NOTE [ Delayed weight gradient ], rules 1-2
            output = linear_with_grad_accumulation_and_async_allreduce(
                input, weight.detach(), bias, False, **kwargs
            )
            return self._wgrad_store.record(input, output, weight)
        return linear_with_grad_accumulation_and_async_allreduce(
            input, weight, bias, fusion, **kwargs
        )

    def backward_dw(self) -> None:
        """Compute the delayed weight gradients (``config.delay_wgrad_compute``), adding them
        into ``weight.main_grad`` (gradient_accumulation_fusion) or ``weight.grad``; a no-op
        without the option, where backward computes them (NOTE [ Delayed weight gradient ])."""
        if self._wgrad_store is not None:
            self._wgrad_store.compute(self.gradient_accumulation_fusion)

    def set_extra_state(self, state: Any) -> None:
        """Ignore ``state``: the ``_extra_state`` entry exists for megatron-core's (and
        Transformer Engine's) state-dict layout only."""

    def get_extra_state(self) -> None:
        """None, stored as ``<prefix>_extra_state`` in the state dict, as megatron-core does."""
        return None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None) -> dict:
        """megatron-core's dist_checkpointing view of this layer: the weight (and a column
        layer's bias) split over TP, other tensors replicated, ``_extra_state`` an object.
        See NOTE [ Sharded state dict ] in tensor_parallel/sharded_state.py."""
        return sharded_state_dict_of_layer(self, prefix, self._TP_AXES, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"bias={self.bias is not None}, TP={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
