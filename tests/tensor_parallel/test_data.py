"""broadcast_data on gloo ranks: values, shapes and dtypes from TP rank 0, and errors on every rank.

Each tensor-parallel group's source (TP rank 0) builds its batch from a seed that includes its
global rank, so a rank that received another group's batch would fail the comparison. The other
ranks pass None or a batch of their own, which must be ignored.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core import parallel_state as ps
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import broadcast_data
from megatron_core.testing import run_distributed

CONFIGS = {1: [1], 2: [2], 4: [4, 2]}  # world size -> tensor-parallel sizes run there
KEYS = ["text", "labels", "mask", "scalar"]


def _batch(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    values = {
        "text": torch.randint(0, 100, (2, 5), generator=gen),
        "labels": torch.randint(0, 100, (2, 5), generator=gen).t(),  # non-contiguous
        "mask": torch.randint(0, 2, (2, 1, 5, 5), generator=gen),
        "scalar": torch.tensor(float(seed)),
        "unused": torch.zeros(3),
    }
    return {k: v.to(dtype) if k != "unused" else v for k, v in values.items()}


def _check_values(dtype):
    src = ps.get_tensor_model_parallel_src_rank()
    expected = _batch(src, dtype)
    tp_rank = ps.get_tensor_model_parallel_rank()
    data = expected if tp_rank == 0 else (None if tp_rank % 2 else _batch(99, dtype))
    out = broadcast_data(KEYS, data, dtype)
    assert list(out) == KEYS
    for key in KEYS:
        assert out[key].dtype == dtype and out[key].device == device.current_device()
        torch.testing.assert_close(out[key].cpu(), expected[key], rtol=0, atol=0)  # exact copy


def _check_errors():
    src, tp_rank = ps.get_tensor_model_parallel_src_rank(), ps.get_tensor_model_parallel_rank()
    good = _batch(src, torch.int64)
    cases = [
        ({k: v for k, v in good.items() if k != "mask"}, r"key 'mask' is missing"),
        (
            {**good, "labels": good["labels"].float()},
            r"'labels'\] has dtype torch.float32, expected datatype torch.int64",
        ),
        ({**good, "text": [1, 2]}, r"data\['text'\] is not a tensor"),
        (
            {**good, "mask": torch.zeros([1] * 9, dtype=torch.int64)},
            r"'mask'\] has 9 dimensions, at most 8",
        ),
        (
            None,
            r"data must be a dict of tensors" + (r" \(got NoneType\)$" if tp_rank == 0 else "$"),
        ),
    ]
    for bad, message in cases:
        data = bad if tp_rank == 0 else good  # only the source's data counts
        with pytest.raises(MegatronCoreError, match=rf"global rank {src}\), .*{message}"):
            broadcast_data(KEYS, data, torch.int64)
    with pytest.raises(MegatronCoreError, match="keys must not be empty"):
        broadcast_data([], good, torch.int64)
    with pytest.raises(MegatronCoreError, match=r"datatype \('int64'\)"):
        broadcast_data(KEYS, good, "int64")


def _body(tp_sizes):
    for tp in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        for dtype in (torch.int64, torch.float32, torch.bfloat16):
            _check_values(dtype)
        _check_errors()
        _check_values(torch.int64)  # still in step after the errors
        ps.destroy_model_parallel()
    # An explicit group: the whole world, from global rank 0.
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    data = {"x": torch.arange(4) * (dist.get_rank() + 1)}
    out = broadcast_data(["x"], data, torch.int64, group=dist.group.WORLD)
    torch.testing.assert_close(out["x"].cpu(), torch.arange(4))
    return True


@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_broadcast_data(world_size):
    assert run_distributed(_body, world_size, CONFIGS[world_size], timeout=120) == [True] * (
        world_size
    )
