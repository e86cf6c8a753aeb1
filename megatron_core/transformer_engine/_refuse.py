"""The one way the stand-in says no: an error that names the feature and what runs instead."""

from __future__ import annotations

from megatron_core.errors import MegatronCoreError

__all__ = ["not_provided", "refuse_if_set"]


def not_provided(feature: str, instead: str = "") -> MegatronCoreError:
    """The error for ``feature``, which the Transformer Engine stand-in does not do.

    Args:
        feature: what was asked for, with the value that asked (``"ub_overlap_ag=True
            (userbuffers)"``).
        instead: what to do instead (appended to the message when given).
    """
    message = (
        f"Transformer Engine stand-in (megatron_core.transformer_engine): {feature} is not "
        f"provided; it needs NVIDIA Transformer Engine on a CUDA GPU"
    )
    return MegatronCoreError(f"{message}. {instead}" if instead else message)


def refuse_if_set(owner: str, options: dict[str, object], what: str, instead: str = "") -> None:
    """Raise :func:`not_provided` for the first of ``options`` (name -> value) that is truthy.

    Args:
        owner: the module or function that was given the options (named in the message).
        options: the options to check.
        what: the feature the options ask for (``"userbuffers communication overlap"``).
        instead: see :func:`not_provided`.
    """
    for name, value in options.items():
        if value:
            raise not_provided(f"{owner}({name}={value!r}): {what}", instead)
