"""MegatronCoreError is caught by handlers written for megatron-core's assert-based checks."""

import pytest

from megatron_core import MegatronCoreError, parallel_state


def test_package_error_is_an_assertion_error_and_a_runtime_error():
    assert issubclass(MegatronCoreError, AssertionError)
    assert issubclass(MegatronCoreError, RuntimeError)


def test_a_real_bad_value_is_caught_by_except_assertion_error():
    # compute_rank_layout validates without processes; megatron-core asserts on the same input.
    with pytest.raises(AssertionError, match=r"must divide world size \(4\)"):
        parallel_state.compute_rank_layout(4, tensor_model_parallel_size=3)
