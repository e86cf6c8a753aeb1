"""The package's error type.

Every bad value that megatron_core detects raises :class:`MegatronCoreError` (or a subclass) with a
message that starts with what failed and names the offending values, e.g.
``tensor_model_parallel_size (3) must divide world size (4)``. Checks run before any collective, so
every rank raises the same error instead of one rank hanging in a collective.

megatron-core reports most bad input with ``assert`` statements, and code written against it catches
``AssertionError``. :class:`MegatronCoreError` is therefore both a ``RuntimeError`` and an
``AssertionError``: ``except AssertionError`` written for megatron-core still catches it, and unlike
a bare ``assert`` the check still runs under ``python -O``.
"""

__all__ = ["MegatronCoreError", "ConfigError", "RankDisagreementError", "CollectiveError"]


class MegatronCoreError(RuntimeError, AssertionError):
    """Raised for invalid arguments or misuse of megatron_core (the message names the values).

    A subclass of both ``RuntimeError`` and ``AssertionError`` so that handlers written for
    megatron-core's ``assert``-based checks keep working (see the module docstring).
    """


class ConfigError(MegatronCoreError, ValueError):
    """Raised for an invalid configuration value (``ModelParallelConfig`` and its subclasses).

    Also a ``ValueError``, which is what megatron-core's ``__post_init__`` raises, so
    ``except ValueError`` written for megatron-core still catches it.
    """


class RankDisagreementError(MegatronCoreError):
    """The ranks of a group disagreed (op, shape, dtype or arguments), or one of them failed a
    check; raised with the same message on every rank of the group."""


class CollectiveError(MegatronCoreError):
    """A collective failed inside torch.distributed (timeout, dead peer, torch's own mismatch
    check); the message names the op and the group, the torch error is the ``__cause__``."""
