"""Shared pieces of the Transformer Engine stand-in's tests: seeded tensors, shards, and a
per-rank report of checks by topic (failures kept as text, so one multi-rank run reports every
topic and no rank is left waiting in a collective after another one's failed assert)."""

from __future__ import annotations

import torch

from megatron_core.errors import MegatronCoreError


def randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Standard normal values from their own generator (equal on every rank)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def shard(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal chunks along ``dim``."""
    return tensor.chunk(parts, dim=dim)[index]


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh leaf copy that requires grad."""
    return tensor.detach().clone().requires_grad_()


class Report:
    """One rank's checks by topic; ``failures`` maps a topic to its failed checks' text."""

    def __init__(self) -> None:
        self.topic = ""
        self.checked: dict[str, int] = {}
        self.failures: dict[str, list[str]] = {}

    def _record(self, name: str, failure: str | None) -> None:
        self.checked[self.topic] = self.checked.get(self.topic, 0) + 1
        if failure:
            self.failures.setdefault(self.topic, []).append(f"{name}: {failure}")

    def close(self, name: str, actual, expected, **tol) -> None:
        """``actual`` equals ``expected`` to ``tol`` (torch.testing's defaults), compared in
        fp32 unless ``dtype=True`` asks the dtypes to match too."""
        if actual is None or expected is None:
            return self._record(
                name, f"None (actual {actual is None}, expected {expected is None})"
            )
        if tol.pop("dtype", False) and actual.dtype != expected.dtype:
            return self._record(name, f"dtype {actual.dtype} != {expected.dtype}")
        try:
            torch.testing.assert_close(actual.float(), expected.float(), **tol)
        except AssertionError as exc:
            return self._record(name, str(exc))
        self._record(name, None)

    def true(self, name: str, condition: bool, detail: str = "") -> None:
        self._record(name, None if condition else f"expected True {detail}".strip())

    def raises(self, name: str, fn, *needles: str) -> None:
        """``fn()`` raises MegatronCoreError whose message contains every needle."""
        try:
            fn()
        except MegatronCoreError as exc:
            missing = [n for n in needles if n not in str(exc)]
            return self._record(name, f"{str(exc)!r} lacks {missing}" if missing else None)
        except Exception as exc:  # noqa: BLE001 - the wrong error is what is reported
            return self._record(name, f"raised {type(exc).__name__}: {exc}")
        self._record(name, "raised nothing")

    def result(self) -> dict:
        return {"checked": self.checked, "failures": self.failures}


def assert_topic(results: list[dict], topic: str) -> None:
    """Every rank checked ``topic`` at least once and none failed there."""
    for rank, result in enumerate(results):
        assert result["checked"].get(topic, 0) > 0, f"rank {rank} never checked {topic!r}"
        assert topic not in result["failures"], (rank, result["failures"][topic])
