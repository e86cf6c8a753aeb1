"""tensor_parallel.utils, section divide / split / VocabUtility: pure logic, no processes."""

import pytest
import torch

from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import (
    VocabUtility,
    divide,
    ensure_divisibility,
    split_tensor_along_last_dim,
)


def test_divide_exact():
    assert divide(12, 4) == 3
    assert divide(0, 5) == 0
    ensure_divisibility(8, 2)


@pytest.mark.parametrize("numerator, denominator", [(10, 4), (3, 0), (3, -1), (7, 2)])
def test_divide_names_both_values(numerator, denominator):
    with pytest.raises(MegatronCoreError, match=rf"\({denominator}\)|{numerator}.*{denominator}"):
        divide(numerator, denominator)


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_split_tensor_along_last_dim(parts):
    x = torch.arange(24.0).reshape(3, 8)
    chunks = split_tensor_along_last_dim(x, parts)
    assert len(chunks) == parts
    for i, chunk in enumerate(chunks):
        torch.testing.assert_close(chunk, x[:, i * 8 // parts : (i + 1) * 8 // parts])
    if parts > 1:
        assert not chunks[0].is_contiguous()  # views, like torch.split
    assert all(c.is_contiguous() for c in split_tensor_along_last_dim(x, parts, True))
    torch.testing.assert_close(torch.cat(chunks, dim=-1), x)


def test_split_tensor_along_last_dim_errors():
    with pytest.raises(MegatronCoreError, match=r"last dimension \(8\).*num_partitions \(3\)"):
        split_tensor_along_last_dim(torch.zeros(2, 8), 3)
    with pytest.raises(MegatronCoreError, match="0-d"):
        split_tensor_along_last_dim(torch.tensor(1.0), 1)
    with pytest.raises(MegatronCoreError, match=r"num_partitions \(0\)"):
        split_tensor_along_last_dim(torch.zeros(4), 0)


def test_vocab_ranges_cover_the_vocabulary_in_rank_order():
    world_size, vocab = 4, 32
    ranges = [VocabUtility.vocab_range_from_global_vocab_size(vocab, r, 4) for r in range(4)]
    assert ranges == [(0, 8), (8, 16), (16, 24), (24, 32)]
    for rank in range(world_size):
        per_partition = VocabUtility.vocab_range_from_per_partition_vocab_size(8, rank, world_size)
        assert per_partition == ranges[rank]
    assert VocabUtility.vocab_range_from_global_vocab_size(5, 0, 1) == (0, 5)


def test_vocab_range_errors():
    with pytest.raises(MegatronCoreError, match=r"global_vocab_size \(10\).*world_size \(4\)"):
        VocabUtility.vocab_range_from_global_vocab_size(10, 0, 4)
    with pytest.raises(MegatronCoreError, match=r"rank \(4\).*world_size \(4\)"):
        VocabUtility.vocab_range_from_per_partition_vocab_size(8, 4, 4)
    with pytest.raises(MegatronCoreError, match=r"rank \(-1\)"):
        VocabUtility.vocab_range_from_global_vocab_size(8, -1, 2)
    with pytest.raises(MegatronCoreError, match=r"world_size \(0\)"):
        VocabUtility.vocab_range_from_global_vocab_size(8, 0, 0)
