"""What rank 0 prints while training: a header, one line per log interval, a summary."""

from __future__ import annotations

import sys
import time

from megatron_core import device

__all__ = ["Progress", "format_bytes"]


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Collects per-iteration numbers and prints them every ``log_interval`` iterations.

    Args:
        enabled: print (rank 0) or only collect (other ranks).
        train_iters: the last iteration, for the "i/N" display.
        log_interval: iterations per printed line.
        tokens_per_iteration: tokens of one global batch (all data-parallel ranks).
    """

    def __init__(
        self,
        enabled: bool,
        train_iters: int,
        log_interval: int,
        tokens_per_iteration: int,
        world_size: int = 1,
    ):
        self.enabled = enabled
        self.world_size = world_size
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.tokens_per_iteration = tokens_per_iteration
        self.losses: list[float] = []
        self.window: list[float] = []
        self.peak_activation_bytes = 0
        self.start = self.window_start = time.perf_counter()

    def print(self, text: str) -> None:
        """Print ``text`` (rank 0 only) and flush, so torchrun shows it at once."""
        if self.enabled:
            print(text, file=sys.stdout, flush=True)

    def step(self, iteration: int, loss: float, lr: float, activation_bytes: int) -> None:
        """Record one finished iteration; print a line at the end of a log interval."""
        self.losses.append(loss)
        self.window.append(loss)
        self.peak_activation_bytes = max(self.peak_activation_bytes, activation_bytes)
        if iteration % self.log_interval and iteration != self.train_iters:
            return
        device.synchronize()
        now = time.perf_counter()
        seconds = (now - self.window_start) / len(self.window)
        mean_loss = sum(self.window) / len(self.window)
        self.print(
            f"iteration {iteration:>6}/{self.train_iters} | loss {mean_loss:.4f}"
            f" | lr {lr:.2e} | {self.tokens_per_iteration / seconds:,.0f} tokens/s"
            f" ({self.tokens_per_iteration / seconds / self.world_size:,.0f} per rank)"
            f" | {1000 * seconds:.1f} ms/iter | activations {format_bytes(activation_bytes)}"
        )
        self.window, self.window_start = [], now

    def elapsed(self) -> float:
        """Seconds since the progress started."""
        return time.perf_counter() - self.start

    def tokens_per_second(self) -> float:
        """Global tokens per second over all recorded iterations."""
        return len(self.losses) * self.tokens_per_iteration / max(self.elapsed(), 1e-9)

    def summary(self, first_iteration: int, last_iteration: int) -> None:
        """Print the final summary line."""
        if not self.losses:
            self.print(f"nothing to train: the run is at iteration {last_iteration} already")
            return
        n = min(self.log_interval, len(self.losses))
        first, last = sum(self.losses[:n]) / n, sum(self.losses[-n:]) / n
        self.print(
            f"done: iterations {first_iteration + 1}-{last_iteration} in {self.elapsed():.1f} s "
            f"({self.tokens_per_second():,.0f} tokens/s); loss {first:.4f} (mean of the first "
            f"{n} iterations) -> {last:.4f} (last {n}); peak activations "
            f"{format_bytes(self.peak_activation_bytes)} per microbatch"
        )
