"""The package's error type.

Every bad value that megatron_core detects raises :class:`MegatronCoreError` (or a subclass) with a
message that starts with what failed and names the offending values, e.g.
``tensor_model_parallel_size (3) must divide world size (4)``. Checks run before any collective, so
every rank raises the same error instead of one rank hanging in a collective.
"""

__all__ = ["MegatronCoreError"]


class MegatronCoreError(RuntimeError):
    """Raised for invalid arguments or misuse of megatron_core (the message names the values)."""
