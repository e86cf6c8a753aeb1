"""What the layer tests compare against: full weights drawn as megatron-core's CPU
initialization draws them, their shards, and a per-rank report of checks by topic.

``Report`` keeps failures as text instead of raising, so one multi-rank run reports every
topic at once. ``check_dtype``: whether ``close`` also requires the reference's dtype (the
autocast tests) or compares in fp32 (the layer tests, whose references are fp32 by design).
"""

import torch

from megatron_core.errors import MegatronCoreError


def init_method(tensor):
    return torch.nn.init.normal_(tensor, std=0.5)


def full_weight(out_size, in_size, seed):
    """The full master weight that megatron-core's CPU initialization draws after seeding."""
    torch.manual_seed(seed)
    return init_method(torch.empty(out_size, in_size))


def shard(tensor, dim, tp, rank):
    return tensor.chunk(tp, dim=dim)[rank]


def leaf(tensor):
    """A fresh leaf copy that requires grad."""
    return tensor.detach().clone().requires_grad_()


class Report:
    """One rank's checks, by topic; failures are kept as text instead of raised."""

    def __init__(self, check_dtype: bool):
        self.check_dtype = check_dtype
        self.topic = None
        self.checked: dict[str, int] = {}
        self.failures: dict[str, list[str]] = {}

    def _record(self, name, failure):
        self.checked[self.topic] = self.checked.get(self.topic, 0) + 1
        if failure:
            self.failures.setdefault(self.topic, []).append(f"{name}: {failure}")

    def close(self, name, actual, expected, tol):
        if actual is None or expected is None:
            return self._record(name, f"got None (actual {actual is None})")
        if self.check_dtype and actual.dtype != expected.dtype:
            return self._record(name, f"dtype {actual.dtype} != reference {expected.dtype}")
        if not self.check_dtype:
            actual, expected = actual.float(), expected.float()
        try:
            torch.testing.assert_close(actual, expected, **tol)
        except AssertionError as exc:
            return self._record(name, str(exc))
        self._record(name, None)

    def true(self, name, condition):
        self._record(name, None if condition else "expected True")

    def raises(self, name, fn, *needles):
        """fn() must raise MegatronCoreError whose message contains every needle."""
        try:
            fn()
        except MegatronCoreError as exc:
            missing = [n for n in needles if n not in str(exc)]
            return self._record(name, f"message {str(exc)!r} lacks {missing}" if missing else None)
        self._record(name, "no MegatronCoreError")
