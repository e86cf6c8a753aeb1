"""The determinism check of a checkpoint's recompute: cheap tensor fingerprints and the error.

NOTE [ Checkpoint rules ], rule 6 in entry_points.py. Used by saved_inputs.py (distributed
inputs), entry_points.py (reentrant outputs) and nonreentrant.py (saved tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.errors import MegatronCoreError

__all__ = [
    "DETERMINISM_RTOL",
    "Fingerprint",
    "check_outputs",
    "determinism_error",
    "output_fingerprints",
    "tensor_name",
]

# --- determinism check (rule 6) ----------------------------------------------------------------

# Relative to the tensor's sum of |x| (float64): absorbs summation-order noise of kernels that
# reduce in a different order on a second run, while one changed dropout mask moves the
# checksums by a large fraction of that sum.
DETERMINISM_RTOL = 1e-6


@dataclass(frozen=True)
class Fingerprint:
    """Metadata and a cheap checksum of one tensor: sum, position-weighted sum, sum of ``|x|``."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    sums: torch.Tensor | None  # float64 [3]; None when only the metadata is compared

    @classmethod
    def of(cls, t: torch.Tensor, name: str, values: bool) -> Fingerprint:
        """Fingerprint ``t``; its values too when ``values`` (costs one pass over ``t``)."""
        sums = None
        if values:
            with torch.no_grad():
                flat = t.detach().reshape(-1).to(torch.float64)
                weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64)
                weights = weights.remainder_(251).add_(1)  # detects permuted values
                sums = torch.stack([flat.sum(), flat.dot(weights), flat.abs().sum()])
        return cls(name, t.shape, t.dtype, sums)

    def mismatch(self, other: Fingerprint) -> str | None:
        """None when ``other`` matches, else what differs."""
        if (self.shape, self.dtype) != (other.shape, other.dtype):
            return (
                f"forward had {self.dtype} {list(self.shape)}, "
                f"recompute {other.dtype} {list(other.shape)}"
            )
        if self.sums is None or other.sums is None:
            return None
        a, b = self.sums.cpu(), other.sums.cpu()
        tol = DETERMINISM_RTOL * max(float(a[2]), float(b[2]))
        same = (a == b) | ((a - b).abs() <= tol) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return None
        return f"values differ (checksums forward {a.tolist()}, recompute {b.tolist()})"


def tensor_name(t: torch.Tensor) -> str:
    """A short description for error messages: dtype, shape and the op that produced it."""
    made_by = f", produced by {type(t.grad_fn).__name__}" if t.grad_fn is not None else ""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}{made_by}"


def output_fingerprints(outputs: Any) -> list[Fingerprint]:
    """Value fingerprints of the tensors among ``outputs`` (a tensor or a tuple)."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [
        Fingerprint.of(o, f"output #{i} ({tensor_name(o)})", values=True)
        for i, o in enumerate(outputs)
        if torch.is_tensor(o)
    ]


def check_outputs(expected: list[Fingerprint], outputs: Any) -> None:
    """Raise if the recomputed ``outputs`` differ from the forward's (rule 6)."""
    got = output_fingerprints(outputs)
    if len(got) != len(expected):
        raise determinism_error(f"forward returned {len(expected)} tensors, recompute {len(got)}")
    for want, have in zip(expected, got):
        problem = want.mismatch(have)
        if problem is not None:
            raise determinism_error(f"{want.name}: {problem}")


def determinism_error(what: str) -> MegatronCoreError:
    """The error of a failed forward/recompute comparison (rules 5 and 6)."""
    return MegatronCoreError(
        f"checkpoint recompute differs from the forward: {what}. The function must compute the "
        "same thing twice: draw randomness only from the default generators or the RNG tracker "
        "(a private torch.Generator is not replayed), read no state that changes between forward "
        "and backward, and avoid non-deterministic ops (NOTE [ Checkpoint rules ], rules 2, 5, 6)"
    )
