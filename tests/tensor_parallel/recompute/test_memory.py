"""count_saved_activations: exact byte counts of what autograd saves, regions, held bytes, hooks.

Every expected number is computed by hand from the shapes (float32 = 4 bytes): the counter must
match exactly, so comparisons are ==, never approximate.
"""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from megatron_core import parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import checkpoint
from megatron_core.tensor_parallel.recompute.memory import (
    count_saved_activations,
    storage_key_and_nbytes,
)
from megatron_core.testing import run_distributed

F32 = 4  # bytes per float32 element


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def test_product_saves_both_factors():
    x, w = _leaf(3, 4), _leaf(3, 4)
    with count_saved_activations() as report:
        y = x * w
    assert report.total_bytes == 2 * 12 * F32
    assert report.num_saved == 2
    assert report.by_device == {"cpu": 2 * 12 * F32}
    assert report.held_bytes == report.peak_held_bytes == report.total_bytes
    y.sum().backward()
    assert report.held_bytes == 0  # backward freed the saved tensors (after the block)
    assert report.total_bytes == 2 * 12 * F32


def test_linear_saves_input_and_weight_once_when_used_twice():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = _leaf(4, 8)
    with count_saved_activations() as report:
        h = lin(x)  # saves x and the weight (needed for the grad of x)
        y = lin(h)  # saves h and the same weight again: one storage, counted once
    assert report.num_saved == 4
    assert report.total_bytes == 2 * 4 * 8 * F32 + 8 * 8 * F32
    with count_saved_activations(ignore=lin.parameters()) as activations:
        y = lin(lin(x))
    assert activations.total_bytes == 2 * 4 * 8 * F32
    del y, h


def test_views_of_one_storage_count_once_and_slices_count_their_base():
    x = _leaf(8)
    with count_saved_activations() as report:
        base = x * 1.0  # MulBackward with a scalar saves nothing
        y = base[:4] * base[4:]  # saves two views of base's storage
    assert report.num_saved == 2
    assert report.total_bytes == 8 * F32
    del y


def test_regions_attribute_to_the_innermost_and_accumulate():
    x, w = _leaf(2, 3), _leaf(2, 3)
    with count_saved_activations() as report:
        with report.region("a"):
            y = x * w  # x, w
        with report.region("b"):
            z = y.exp()  # saves its output (new storage)
            with report.region("c"):
                u = z.sin()  # saves z again (already counted for b) ...
                v = u.exp()  # ... and v
        with report.region("a"):
            t = v.sigmoid()  # saves its output: accumulates in "a"
        s = t.tanh()  # outside any region
    six = 6 * F32
    assert report.by_region == {"a": 3 * six, "b": six, "c": six}
    assert report.unattributed_bytes == six
    assert report.total_bytes == 6 * six
    del s


def test_no_grad_forward_counts_nothing():
    x, w = _leaf(3, 4), _leaf(3, 4)
    with count_saved_activations() as report, torch.no_grad():
        (x * w).exp()
    assert (report.total_bytes, report.num_saved, report.peak_held_bytes) == (0, 0, 0)


def test_zero_size_and_meta_tensors():
    empty = _leaf(0, 4)
    with count_saved_activations() as report:
        y = empty * empty
    assert report.total_bytes == 0 and report.num_saved == 2
    del y
    key, nbytes = storage_key_and_nbytes(torch.empty(3, device="meta"))
    assert key is None and nbytes == 3 * F32


def test_held_bytes_fall_when_the_graph_is_dropped_without_backward():
    x = _leaf(5)
    with count_saved_activations() as report:
        y = x.exp()
    assert report.held_bytes == 5 * F32
    del y
    gc.collect()
    assert report.held_bytes == 0 and report.peak_held_bytes == 5 * F32


def test_gradients_are_unchanged_by_counting():
    torch.manual_seed(0)
    x, w = _leaf(4, 5), _leaf(5, 3)
    (torch.tanh(x @ w) ** 2).sum().backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with count_saved_activations():
        loss = (torch.tanh(x @ w) ** 2).sum()
    loss.backward()
    torch.testing.assert_close((x.grad, w.grad), expected, rtol=0, atol=0)  # same kernels


def _region_fn(w):
    return lambda x: (x * w).exp().sin()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torch_checkpoint_keeps_only_its_input(use_reentrant):
    x, w = _leaf(6, 4), _leaf(6, 4)
    with count_saved_activations(ignore=[w]) as report:
        y = torch_checkpoint.checkpoint(_region_fn(w), x, use_reentrant=use_reentrant)
    # Reentrant: save_for_backward(x). Non-reentrant: its inner hooks hide the region (rule 5)
    # and it keeps x through save_for_backward outside them.
    assert report.total_bytes == 24 * F32
    y.sum().backward()
    assert report.held_bytes == 0


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_our_checkpoint_keeps_only_its_input(use_reentrant):
    x, w = _leaf(6, 4), _leaf(6, 4)
    with count_saved_activations(ignore=[w]) as report:
        with report.region("ckpt"):
            y = checkpoint(_region_fn(w), False, x, use_reentrant=use_reentrant)
        z = y.exp()  # saves its output outside the region
    assert report.by_region == {"ckpt": 24 * F32}
    assert report.total_bytes == 2 * 24 * F32
    with count_saved_activations(ignore=[w], include_checkpoint_inputs=False) as hidden:
        checkpoint(_region_fn(w), False, x, use_reentrant=use_reentrant)
    assert hidden.total_bytes == (24 * F32 if use_reentrant else 0)  # rule 6
    z.sum().backward()
    gc.collect()
    assert report.held_bytes == 0


def test_offloaded_checkpoint_input_is_a_separate_copy():
    x, w = _leaf(6, 4), _leaf(6, 4)
    with count_saved_activations(ignore=[w]) as report:
        checkpoint(_region_fn(w), False, x, use_reentrant=False, offload_to_cpu=True)
    assert report.by_device == {"cpu": 24 * F32}


def test_counter_inside_an_enclosing_checkpoint_forwards_to_its_hooks():
    torch.manual_seed(0)
    x, w = _leaf(4, 3), _leaf(4, 3)
    reports = []

    def counted(x):
        with count_saved_activations() as report:
            reports.append(report)
            return (x * w).exp()

    torch_checkpoint.checkpoint(counted, x, use_reentrant=False).sum().backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    counted(x).sum().backward()
    torch.testing.assert_close((x.grad, w.grad), grads, rtol=0, atol=0)  # same kernels
    assert reports[0].total_bytes == 3 * 12 * F32  # offered for saving: x, w, exp's output


def test_bad_arguments_are_refused():
    with pytest.raises(MegatronCoreError, match="region name"):
        with count_saved_activations() as report, report.region(""):
            pass
    with pytest.raises(MegatronCoreError, match="include_checkpoint_inputs"):
        with count_saved_activations(include_checkpoint_inputs=1):
            pass


def _distributed_saved_bytes(numel):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    x = torch.randn(numel, requires_grad=True)
    out = []
    for use_reentrant in (True, False):
        with count_saved_activations() as report:
            y = checkpoint(torch.sin, True, x, use_reentrant=use_reentrant)
        out.append(report.total_bytes)
        y.sum().backward()
    return out


def test_distributed_checkpoint_keeps_one_chunk_per_rank():
    numel, tp = 10, 2  # ceil(10 / 2) = 5 elements per rank
    for per_rank in run_distributed(_distributed_saved_bytes, tp, numel, timeout=120):
        assert per_rank == [5 * F32, 5 * F32]


def test_record_counts_tensors_kept_outside_hooks_until_their_owner_dies():
    class Owner:
        pass

    kept, owner = torch.zeros(10), Owner()
    with count_saved_activations() as report:
        report.record(kept, owner)
        report.record(kept[2:], owner)  # the same storage: counted once
    assert report.total_bytes == report.held_bytes == 10 * F32
    del owner
    gc.collect()
    assert report.held_bytes == 0


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="no accelerator on this machine")
def test_accelerator_tensors_are_counted_by_device():
    where = torch.accelerator.current_accelerator()
    x = torch.randn(3, 4, device=where, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)  # a CPU tensor saved next to it
    with count_saved_activations() as report:
        y = (x * x).sum() + (w * w).sum()
    by_device = {name.split(":")[0]: n for name, n in report.by_device.items()}
    assert by_device == {where.type: 12 * F32, "cpu": 12 * F32}
    y.backward()
    assert report.held_bytes == 0


def test_resident_bytes_see_an_output_released_until_backward():
    from megatron_core.tensor_parallel import CheckpointWithoutOutput

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(64, 8, requires_grad=True)
    with count_saved_activations(ignore=lin.parameters()) as report:
        ckpt = CheckpointWithoutOutput()
        act = ckpt.checkpoint(torch.nn.functional.gelu, x * 2.0)
        out = lin(act)  # saves act
        before = report.resident_bytes()
        ckpt.discard_output_and_register_recompute(out)
    assert before == report.held_bytes == report.total_bytes
    assert report.resident_bytes() == before - act.numel() * 4  # fp32: 4 bytes per element
    out.sum().backward()
    assert report.held_bytes == 0 and report.resident_bytes() == 0
