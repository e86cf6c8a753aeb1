"""utils.py 1-D chunks: split_tensor_into_1d_equal_chunks / gather_split_1d_tensor round trips."""

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.utils import (
    chunk_numel_1d,
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)
from megatron_core.testing import run_distributed

# Element counts: divisible by 1, 2 and 4 (8), by none of 2 and 4 (105), fewer than tp (1, 3),
# and empty (0).
NUMELS = (8, 105, 1, 3, 0)


def test_chunk_numel_is_ceil_division():
    assert [chunk_numel_1d(n, 4) for n in (0, 1, 4, 5, 8, 105)] == [0, 1, 1, 2, 2, 27]
    assert chunk_numel_1d(105, 1) == 105
    with pytest.raises(MegatronCoreError, match=r"world_size \(0\) must be an integer >= 1"):
        chunk_numel_1d(3, 0)


def test_split_without_parallel_state_is_refused():
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(MegatronCoreError, match="not initialized"):
        split_tensor_into_1d_equal_chunks(torch.ones(4))


def _body_round_trip() -> list[str]:
    """Every NUMELS size on this rank: chunk length, padding, views, exact round trip."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=torch.distributed.get_world_size()
    )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    problems = []
    for numel in NUMELS:
        full = torch.arange(1, numel + 1, dtype=torch.float32).reshape(-1, 1)
        size = -(-numel // tp)
        chunk = split_tensor_into_1d_equal_chunks(full)
        fresh = split_tensor_into_1d_equal_chunks(full, new_buffer=True)
        real = full.reshape(-1)[rank * size : (rank + 1) * size]
        expected = torch.cat([real, torch.zeros(size - real.numel())])
        if chunk.shape != (size,) or not torch.equal(chunk, expected):
            problems.append(f"numel {numel}: chunk {chunk.tolist()} != {expected.tolist()}")
        if not torch.equal(fresh, expected):
            problems.append(f"numel {numel}: new_buffer chunk {fresh.tolist()}")
        if numel and fresh.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            problems.append(f"numel {numel}: new_buffer=True shares storage with the input")
        if (
            numel % tp == 0
            and numel
            and chunk.untyped_storage().data_ptr() != (full.untyped_storage().data_ptr())
        ):
            problems.append(f"numel {numel}: an unpadded chunk without new_buffer is not a view")
        exact = gather_split_1d_tensor(chunk, numel=numel)
        if not torch.equal(exact.view(full.shape), full):
            problems.append(f"numel {numel}: round trip gave {exact.tolist()}")
        padded = gather_split_1d_tensor(chunk)  # megatron-core's call: padding kept
        if padded.numel() != tp * size or not torch.equal(padded[:numel], full.reshape(-1)):
            problems.append(f"numel {numel}: gather without numel gave {padded.tolist()}")
    try:
        gather_split_1d_tensor(torch.ones(2), numel=2 * tp + 1)
        problems.append("a numel that cannot give chunks of 2 was accepted")
    except MegatronCoreError as e:
        if f"numel ({2 * tp + 1}) does not split into chunks of 2 over {tp} ranks" not in str(e):
            problems.append(f"unclear message: {e}")
    return problems


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_split_gather_round_trip(world_size):
    for rank, problems in enumerate(run_distributed(_body_round_trip, world_size, timeout=120)):
        assert problems == [], f"rank {rank}: {problems}"


def _body_explicit_group() -> list[float]:
    """group= instead of parallel_state: the split runs over WORLD without initialization."""
    world = torch.distributed.group.WORLD
    x = torch.arange(10, dtype=torch.float64)
    chunk = split_tensor_into_1d_equal_chunks(x, new_buffer=True, group=world)
    return gather_split_1d_tensor(chunk, numel=10, group=world).tolist()


def test_explicit_group_needs_no_parallel_state():
    for gathered in run_distributed(_body_explicit_group, 4, timeout=60):
        assert gathered == [float(i) for i in range(10)]
