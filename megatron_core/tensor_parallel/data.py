"""Broadcast a batch from tensor-parallel rank 0 to the rest of its group (megatron-core's
``broadcast_data``): one all-gather of a small int64 header (status and sizes), then one
broadcast of a flat buffer holding every tensor.

Only the source rank reads ``data``, so only it can find a missing key or a wrong dtype. It puts
what it found into the header instead of raising alone: every rank then raises the same
MegatronCoreError after the header exchange, before the data broadcast, and no rank is left
waiting in a collective. The header is all-gathered rather than broadcast so that it also
carries every rank's hash of ``keys`` and ``datatype``: ranks that disagree on them (which
would size the data broadcast differently: a gloo abort) raise alike, in every consistency mode,
at no extra collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_core import compat, consistency, device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.parallel_state.agreement import hash_text
from megatron_core.tensor_parallel.utils import pick_group
from megatron_core.utils import get_tensor_model_parallel_group_if_none

__all__ = ["broadcast_data"]

_MAX_DATA_DIM = 8  # dimensions per tensor the header has room for (megatron-core's limit)
_OK, _NO_DATA, _MISSING_KEY, _NOT_A_TENSOR, _WRONG_DTYPE, _TOO_MANY_DIMS = range(6)
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


def _inspect(keys: list, data, datatype: torch.dtype) -> tuple[int, int, int]:
    """(status, index of the offending key, detail) of the source rank's ``data``."""
    if not isinstance(data, Mapping):
        return _NO_DATA, -1, -1
    for index, key in enumerate(keys):
        if key not in data:
            return _MISSING_KEY, index, -1
        value = data[key]
        if not isinstance(value, torch.Tensor):
            return _NOT_A_TENSOR, index, -1
        if value.dtype != datatype:
            found = _DTYPES.index(value.dtype) if value.dtype in _DTYPES else -1
            return _WRONG_DTYPE, index, found
        if value.dim() > _MAX_DATA_DIM:
            return _TOO_MANY_DIMS, index, value.dim()
    return _OK, -1, -1


def _error(status: int, key, detail: int, datatype: torch.dtype, data_type, src: int) -> str:
    """The message every rank raises; only the source rank knows ``data_type`` (else None)."""
    where = f"broadcast_data: on the source rank (global rank {src}), "
    if status == _NO_DATA:
        got = f" (got {data_type})" if data_type is not None else ""
        return where + f"data must be a dict of tensors{got}"
    if status == _MISSING_KEY:
        return where + f"key {key!r} is missing from data"
    if status == _NOT_A_TENSOR:
        return where + f"data[{key!r}] is not a tensor"
    if status == _WRONG_DTYPE:
        found = _DTYPES[detail] if detail >= 0 else "another dtype"
        return where + f"data[{key!r}] has dtype {found}, expected datatype {datatype}"
    return where + f"data[{key!r}] has {detail} dimensions, at most {_MAX_DATA_DIM} are supported"


def _header(keys: list, data, datatype: torch.dtype, source: bool) -> torch.Tensor:
    """[hash of keys and datatype, status, key index, detail, then per key: ndim and
    _MAX_DATA_DIM sizes (zero-padded)]; status and sizes only on the source rank."""
    header = torch.zeros(4 + len(keys) * (1 + _MAX_DATA_DIM), dtype=torch.int64)
    header[0] = hash_text(f"{keys!r} {datatype}")
    if not source:
        return header
    header[1:4] = torch.tensor(_inspect(keys, data, datatype))
    if header[1] == _OK:
        for index, key in enumerate(keys):
            shape = data[key].shape
            at = 4 + index * (1 + _MAX_DATA_DIM)
            header[at] = len(shape)
            header[at + 1 : at + 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return header


def _exchange_headers(header: torch.Tensor, keys, datatype, group, world_size) -> torch.Tensor:
    """Every rank's header (NOTE in the module doc); the source's row, after checking that
    every rank passed the same keys and datatype (else every rank raises, naming them)."""
    if world_size == 1:
        return header
    local = header.to(device.current_device())
    gathered = local.new_empty(world_size * local.numel())
    with consistency.named_failures("broadcast_data (header)", group):
        compat.all_gather_single(gathered, local, group=group)
    rows = gathered.view(world_size, -1).cpu()
    if bool((rows[:, 0] != rows[0, 0]).any()):  # the same table on every rank: all agree to
        consistency.agree("broadcast_data", group, keys=keys, datatype=datatype)  # name them
    return rows[0]


def broadcast_data(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    datatype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Broadcast ``data[key]`` for every key from rank 0 of the tensor-parallel group.

    Sizes go first (one small int64 all-gather, which also compares ``keys`` and ``datatype``
    across the group), then all tensors in one flat buffer of ``datatype``. The results are on
    the current device (CPU under gloo).

    Args:
        keys: the keys to broadcast, the same list on every rank.
        data: dict of tensors on the source rank (tensor-parallel rank 0); ignored (may be None)
            on the other ranks.
        datatype: the dtype of every ``data[key]``.
        tp_group: the group to broadcast over, from its rank 0; default the
            tensor-model-parallel group.
        group: the same as tp_group (this package's older keyword).

    Returns:
        ``{key: tensor}`` on every rank, each tensor with the source's shape (views of one buffer).

    Raises:
        MegatronCoreError: on every rank, if ``keys`` is empty, ``datatype`` is not a dtype, or on
            the source rank a key is missing, a value is not a tensor, has another dtype or more
            than 8 dimensions; RankDisagreementError if the ranks passed different ``keys`` (as
            many of them) or ``datatype``.
    """
    keys = list(keys)
    if not keys:
        raise MegatronCoreError("broadcast_data: keys must not be empty")
    if not isinstance(datatype, torch.dtype):
        raise MegatronCoreError(f"broadcast_data: datatype ({datatype!r}) must be a torch.dtype")
    group = pick_group("broadcast_data", tp_group, group)
    group = get_tensor_model_parallel_group_if_none(group)  # megatron-core's lookup (patchable)
    group = parallel_state.get_tensor_model_parallel_group() if group is None else group
    consistency.check_collective("broadcast_data", group, keys=keys, datatype=datatype)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    src = dist.get_global_rank(group, 0)
    target = device.current_device()

    header = _header(keys, data, datatype, rank == 0)
    header = _exchange_headers(header, keys, datatype, group, world_size)
    status, key_index, detail = header[1:4].tolist()
    if status != _OK:
        key = keys[key_index] if key_index >= 0 else None
        data_type = type(data).__name__ if rank == 0 else None
        raise MegatronCoreError(_error(status, key, detail, datatype, data_type, src))

    shapes = []
    for index in range(len(keys)):
        at = 4 + index * (1 + _MAX_DATA_DIM)
        shapes.append(torch.Size(header[at + 1 : at + 1 + int(header[at])].tolist()))
    total = sum(shape.numel() for shape in shapes)
    if rank == 0:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys]).to(target)
    else:
        flat = torch.empty(total, dtype=datatype, device=target)
    if world_size > 1:
        with consistency.named_failures("broadcast_data", group):
            dist.broadcast(flat, src, group=group)

    output, offset = {}, 0
    for key, shape in zip(keys, shapes):
        output[key] = flat.narrow(0, offset, shape.numel()).view(shape)
        offset += shape.numel()
    return output
