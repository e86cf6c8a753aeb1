"""What a training checkpoint holds, as a flat dict of global names -> tensor shards.

The keys are the same at every parallel layout; each value says which part of the global
tensor this rank holds, so ``torch.distributed.checkpoint`` (DCP) can write the shards once and
read any other cut of them back (resharding). See NOTE [ Checkpoint keys ].

# NOTE [ Checkpoint keys ]
1. Model: ``model.<name>`` for every parameter and persistent buffer, with the layer number
   made global (``decoder.layers.<i + model.layer_offset>.``) so pipeline stages own disjoint
   keys. A ``_extra_state`` that is None is skipped; a tensor one is saved replicated.
2. Shards: a tensor-parallel parameter (``tensor_model_parallel``, ``partition_dim``, stride 1)
   is the slice [tp_rank * n, (tp_rank + 1) * n) of a global tensor n * tp long along
   ``partition_dim``. A weight with ``unpadded_partition_size`` (the vocabulary embedding of a
   padded vocabulary) is saved up to that size only: padding rows are never written, so
   checkpoints of TP sizes that pad differently reshard into each other, and a rank whose slice
   is all padding holds no entry.
3. Replicated tensors (LayerNorm, biases of row-parallel layers, positions, optimizer step
   counts) have no offsets; every rank that holds them offers them and DCP writes one copy.
4. Optimizer: ``optimizer.<name>.<state key>`` for the state of the parameter named ``name``,
   cut like the parameter when it has the parameter's shape, else replicated. An optimizer that
   updates copies of the parameters (fp32 master weights) says so with
   ``checkpoint_param_pairs() -> [(model_param, optimizer_param), ...]``; the copies are saved
   as ``optimizer.master.<name>``, cut like the parameter. Other optimizer state (a loss scaler)
   comes from ``checkpoint_extra_state() -> {key: tensor}`` as ``optimizer.extra.<key>`` and
   goes back through ``load_checkpoint_extra_state({key: tensor})``, called on load before
   anything is modified (with {} when the checkpoint has none), so it may refuse by raising.
5. RNG: ``rng.<global rank>.<stream>``, one set per rank, restored only at the same layout.
"""

from __future__ import annotations

import random as _py_random
import re
from dataclasses import dataclass

import torch

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.rng.state import get_rng_state_dict

__all__ = [
    "Shard",
    "cut",
    "model_names",
    "model_entries",
    "optimizer_entries",
    "rng_entries",
    "optimizer_pairs",
]

_LAYER = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")


@dataclass
class Shard:
    """This rank's part of one global tensor.

    Attributes:
        tensor: the local part (a view of the live tensor on save; a buffer on load).
        global_shape: the whole tensor's shape.
        offsets: where ``tensor`` starts in it, per dimension.
        target: the live tensor the buffer is copied into after a load (None on save).
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    target: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        """True when this rank holds none of it (its slice is all padding), so it is not saved."""
        return any(size == 0 for size in self.tensor.shape)


def _global_name(name: str, layer_offset: int) -> str:
    match = _LAYER.match(name)
    if not layer_offset or not match or ".layers." not in f".{name}":
        return name
    return f"{match.group(1)}{int(match.group(2)) + layer_offset}{match.group(3)}"


def cut(like: torch.Tensor, tensor: torch.Tensor) -> Shard:
    """``tensor`` (shaped like ``like``) as a Shard cut the way ``like`` is: NOTE rule 2."""
    shape, offsets = list(tensor.shape), [0] * tensor.dim()
    if getattr(like, "tensor_model_parallel", False) and tensor.shape == like.shape:
        dim, stride = like.partition_dim, getattr(like, "partition_stride", 1)
        if stride != 1:
            raise MegatronCoreError(
                f"checkpoint: partition_stride ({stride}) of a {list(like.shape)} parameter is "
                "not supported (only contiguous tensor-parallel cuts, stride 1)"
            )
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        local = tensor.shape[dim]
        offsets[dim] = tp_rank * local
        shape[dim] = local * parallel_state.get_tensor_model_parallel_world_size()
        valid = getattr(like, "unpadded_partition_size", None)
        if valid is not None:
            shape[dim] = valid
            tensor = tensor.narrow(dim, 0, max(0, min(local, valid - offsets[dim])))
    return Shard(tensor, tuple(shape), tuple(offsets))


def _chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A model, or the chunks of an interleaved pipeline stage (a ModuleList)."""
    return list(model) if isinstance(model, torch.nn.ModuleList) else [model]


def _model_tensors(model: torch.nn.Module):
    """(global name, tensor) of every chunk; NOTE rule 1."""
    for chunk in _chunks(model):
        offset = getattr(chunk, "layer_offset", 0)
        for name, value in chunk.state_dict(keep_vars=True).items():
            if not (name.endswith("_extra_state") and value is None):
                yield _global_name(name, offset), value


def model_names(model: torch.nn.Module) -> set[str]:
    """Every ``model.<global name>`` of ``model``, held by this rank or not (padding)."""
    return {f"model.{name}" for name, _ in _model_tensors(model)}


def model_entries(model: torch.nn.Module) -> dict[str, tuple[Shard, torch.Tensor]]:
    """``model.<global name>`` -> (Shard of the live tensor, the live tensor); NOTE rules 1-3."""
    entries = {}
    for name, value in _model_tensors(model):
        if name.endswith("_extra_state") and not torch.is_tensor(value):
            raise MegatronCoreError(
                f"checkpoint: {name} holds a {type(value).__name__}; only None or tensor "
                "extra state can be checkpointed"
            )
        shard = cut(value, value.detach())
        if not shard.empty:
            entries[f"model.{name}"] = (shard, value)
    return entries


def optimizer_pairs(
    model: torch.nn.Module, optimizer
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(global parameter name, model parameter, the tensor the optimizer updates) per parameter
    the optimizer steps; NOTE rule 4."""
    names = {}
    for chunk in _chunks(model):
        offset = getattr(chunk, "layer_offset", 0)
        names.update({id(p): _global_name(n, offset) for n, p in chunk.named_parameters()})
    hook = getattr(optimizer, "checkpoint_param_pairs", None)
    if hook is not None:
        pairs = list(hook())
    else:
        pairs = [(p, p) for group in optimizer.param_groups for p in group["params"]]
    result = []
    for model_param, optimizer_param in pairs:
        if id(model_param) not in names:
            raise MegatronCoreError(
                f"checkpoint: the optimizer steps a {list(model_param.shape)} tensor that is not a "
                "parameter of the model"
            )
        result.append((names[id(model_param)], model_param, optimizer_param))
    return result


def _optimizer_state(optimizer):
    return getattr(optimizer, "optimizer", optimizer).state


def optimizer_entries(model: torch.nn.Module, optimizer) -> dict[str, Shard]:
    """``optimizer.<name>.<key>``, ``optimizer.master.<name>`` and ``optimizer.extra.<key>``
    shards of the live optimizer; NOTE rule 4."""
    state = _optimizer_state(optimizer)
    entries = {}
    for name, model_param, optimizer_param in optimizer_pairs(model, optimizer):
        if optimizer_param is not model_param:
            shard = cut(model_param, optimizer_param.detach())
            if not shard.empty:
                entries[f"optimizer.master.{name}"] = shard
        for key, value in state.get(optimizer_param, {}).items():
            if not torch.is_tensor(value):
                value = torch.tensor(value)
            shard = cut(model_param, value.detach())
            if not shard.empty:
                entries[f"optimizer.{name}.{key}"] = shard
    extra = getattr(optimizer, "checkpoint_extra_state", None)
    for key, value in (extra() if extra else {}).items():
        entries[f"optimizer.extra.{key}"] = Shard(
            value.detach(), tuple(value.shape), (0,) * value.dim()
        )
    return entries


def rng_entries(global_rank: int) -> tuple[dict[str, Shard], dict]:
    """This rank's RNG streams as tensors (NOTE rule 5), and the rest of
    ``get_rng_state_dict()`` as JSON-able values."""
    state = get_rng_state_dict()
    version, internal, gauss = _py_random.getstate()
    tensors = {
        "cpu": state["cpu"],
        "device": state["device"],
        "python": torch.tensor(internal, dtype=torch.int64),
        **{f"tracker.{name}": value for name, value in state["tracker"].items()},
    }
    entries = {
        f"rng.{global_rank}.{key}": Shard(t.detach().cpu(), tuple(t.shape), (0,) * t.dim())
        for key, t in tensors.items()
    }
    meta = {
        "version": state["version"],
        "layout": state["layout"],
        "device_type": state["device_type"],
        "python_version": version,
        "python_gauss": gauss,
        "trackers": sorted(state["tracker"]),
    }
    return entries, meta
