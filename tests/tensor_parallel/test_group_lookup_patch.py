"""megatron-core's tests patch ``get_tensor_model_parallel_group_if_none`` in
``tensor_parallel.mappings`` (and ``data``) to hand the region functions another group: a None
group must be resolved through that module-level name, here as there."""

from unittest import mock

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.testing import run_distributed


def _regions_obey_a_patched_group_lookup():
    from megatron_core.tensor_parallel import data, mappings

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    x = torch.full((3,), float(rank + 1))
    summed = mappings.reduce_from_tensor_model_parallel_region(x.clone())
    calls = []

    def own_group(group, *args, **kwargs):
        calls.append(group)
        return singles[rank]

    with mock.patch.object(mappings, "get_tensor_model_parallel_group_if_none", own_group):
        alone = mappings.reduce_from_tensor_model_parallel_region(x.clone())
        gathered = mappings.gather_from_tensor_model_parallel_region(x.clone())
    with mock.patch.object(data, "get_tensor_model_parallel_group_if_none", own_group):
        received = data.broadcast_data(["ids"], {"ids": x.long()}, torch.int64)["ids"].cpu()
    return summed, alone, gathered, received, calls


def test_regions_resolve_a_none_group_through_the_patchable_lookup():
    for rank, (summed, alone, gathered, received, calls) in enumerate(
        run_distributed(_regions_obey_a_patched_group_lookup, 2, timeout=120)
    ):
        mine = torch.full((3,), float(rank + 1))
        torch.testing.assert_close(summed, torch.full((3,), 3.0))  # unpatched: the TP group
        torch.testing.assert_close(alone, mine)  # patched: a one-rank group, nothing summed
        torch.testing.assert_close(gathered, mine)
        torch.testing.assert_close(received, mine.long())  # each rank is its own source
        assert calls == [None, None, None]
