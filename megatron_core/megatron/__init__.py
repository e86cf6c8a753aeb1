"""The megatron switch: megatron-core's own model code runs on this package.

Call :func:`install` once, before anything imports ``megatron``::

    import megatron_core.megatron
    megatron_core.megatron.install()

    from megatron.core.models.gpt import GPTModel          # megatron-core's own model code ...
    from megatron.core import parallel_state, tensor_parallel  # ... on this package's modules

After it, each megatron name in :data:`SERVED` is this package's module object (the same object
under both names, one global state); every other ``megatron`` name is installed megatron-core's
own (NOTE [ Serving megatron-core's modules ] in ``_finder.py``). Test runners that cannot make
the call set ``MEGATRON_CORE_SWITCH=1`` and use the pytest plugin (``-p
megatron_core.megatron.pytest_plugin``) or ``python -m megatron_core.megatron script.py``.

megatron-core is an optional extra (``pip install "megatron-tp-core[megatron]"``); the switch
accepts the releases it was tested with (:data:`SUPPORTED_VERSIONS`) and refuses others unless
``MEGATRON_CORE_SWITCH_ANY_VERSION=1``.

Where no real Transformer Engine is importable, the switch also serves this package's
Transformer Engine stand-in as ``transformer_engine`` (``megatron_core.transformer_engine``;
NOTE [ Serving the Transformer Engine stand-in ] in ``te_stand_in.py``), so megatron-core's
Transformer Engine layer spec runs on it.

On a torch without CUDA the switch also turns on its CPU mode (``cpu_mode.py``, NOTE [ CUDA on
the CPU ]): megatron-core's CUDA calls run on the CPU. ``install(cuda_on_cpu=False)`` or
``MEGATRON_CORE_CUDA_ON_CPU=0`` keeps it off.
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings

from megatron_core import flags
from megatron_core.errors import MegatronCoreError
from megatron_core.megatron import _children, cpu_mode, te_stand_in, without_te
from megatron_core.megatron._finder import MegatronSwitchFinder
from megatron_core.tensor_parallel.linear.base import set_expert_grad_rule

__all__ = [
    "SERVED",
    "SUPPORTED_VERSIONS",
    "SWITCH_ENV",
    "ANY_VERSION_ENV",
    "CUDA_ON_CPU_ENV",
    "install",
    "uninstall",
    "is_installed",
    "megatron_core_version",
    "check_version",
    "install_from_env",
]

SWITCH_ENV = "MEGATRON_CORE_SWITCH"
ANY_VERSION_ENV = "MEGATRON_CORE_SWITCH_ANY_VERSION"
CUDA_ON_CPU_ENV = cpu_mode.ENV

# Releases the switch was tested with, end to end: 0.16.1 (Python 3.10/3.11) and 0.19.2 (3.12;
# 0.17+ requires it); README "Support matrix".
SUPPORTED_VERSIONS = ("0.16.1", "0.19.*")

_TP = "megatron.core.tensor_parallel"
_PP = "megatron.core.pipeline_parallel"

# megatron name -> this package's module. A module is served only where this package implements
# megatron-core's whole public surface of it (tests/megatron/test_megatron_switch.py checks the
# names).
SERVED: dict[str, str] = {
    "megatron.core.parallel_state": "megatron_core.parallel_state",
    "megatron.core.model_parallel_config": "megatron_core.model_parallel_config",
    "megatron.core.process_groups_config": "megatron_core.process_groups_config",
    "megatron.core.enums": "megatron_core.enums",
    "megatron.core.hyper_comm_grid": "megatron_core.hyper_comm_grid",
    _TP: "megatron_core.tensor_parallel",
    **{
        f"{_TP}.{name}": f"megatron_core.tensor_parallel.{name}"
        for name in (
            "cross_entropy",
            "data",
            "inference_layers",
            "layers",
            "mappings",
            "random",
            "utils",
        )
    },
    _PP: "megatron_core.pipeline_parallel",
    f"{_PP}.schedules": "megatron_core.pipeline_parallel.schedules",
    f"{_PP}.p2p_communication": "megatron_core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.finalize_model_grads": (
        "megatron_core.distributed.finalize_model_grads"
    ),
}

_FINDER: MegatronSwitchFinder | None = None


def _env_on(name: str) -> bool:
    """Whether environment variable ``name`` is 1/true/yes/on (any case); a value that is
    neither a yes nor a no raises (``flags.flag``)."""
    return flags.flag(name) is True


def megatron_core_version() -> str | None:
    """The installed megatron-core release (read from its metadata, without importing it)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _supported(version: str) -> bool:
    for pattern in SUPPORTED_VERSIONS:
        if pattern.endswith(".*"):
            prefix = pattern[:-1]
            if version.startswith(prefix) and version[len(prefix) :].split(".")[0].isdigit():
                return True
        elif version == pattern:
            return True
    return False


def check_version(version: str | None = None) -> str:
    """Return the installed megatron-core release if the switch supports it, else raise.

    Raises:
        MegatronCoreError: megatron-core is not installed, or its release is not one of
            :data:`SUPPORTED_VERSIONS` and ``MEGATRON_CORE_SWITCH_ANY_VERSION`` is not set
            (with it set, a warning instead).
    """
    version = megatron_core_version() if version is None else version
    if version is None:
        raise MegatronCoreError(
            "megatron switch: megatron-core is not installed; install the extra with "
            "pip install \"megatron-tp-core[megatron]\" (megatron-core 0.16.1, or 0.19.x on "
            "Python 3.12)"
        )
    if _supported(version):
        return version
    message = (
        f"megatron switch: megatron-core {version} is not a tested release "
        f"(tested: {', '.join(SUPPORTED_VERSIONS)})"
    )
    if _env_on(ANY_VERSION_ENV):
        warnings.warn(f"{message}; going on because {ANY_VERSION_ENV} is set", stacklevel=3)
        return version
    raise MegatronCoreError(f"{message}; set {ANY_VERSION_ENV}=1 to try it anyway")


def _foreign_imports() -> list[str]:
    """Claimed names already imported as megatron-core's own modules."""
    return sorted(
        name
        for name, target in SERVED.items()
        if name in sys.modules and sys.modules[name] is not sys.modules.get(target)
    )


def is_installed() -> bool:
    """Whether the switch is active in this process."""
    return _FINDER is not None and _FINDER in sys.meta_path


def install(cuda_on_cpu: bool | None = None) -> None:
    """Serve the :data:`SERVED` megatron names from this package (idempotent).

    It holds in this process and in the processes it starts (NOTE [ Switch in every process ] in
    ``_children.py``: spawn/forkserver children install it before they unpickle anything, and
    ``MEGATRON_CORE_SWITCH=1`` is set for programs that ask the environment).

    Args:
        cuda_on_cpu: the CPU mode (NOTE [ CUDA on the CPU ] in ``cpu_mode.py``): True / False
            turn it on / off; None reads ``MEGATRON_CORE_CUDA_ON_CPU`` and, where that is unset,
            turns it on exactly when torch has no CUDA device. A later call with True / False
            changes it; with None it keeps what the first call decided. spawn/forkserver
            children get the same answer.

    Raises:
        MegatronCoreError: megatron-core is missing or untested (:func:`check_version`), or a
            claimed megatron module was already imported from megatron-core (``install`` must run
            before ``megatron`` is imported; the message names the modules), or
            ``MEGATRON_CORE_CUDA_ON_CPU`` has a value that is not a yes or a no.
    """
    global _FINDER
    first = not is_installed()
    want = cpu_mode.wanted(cuda_on_cpu) if first or cuda_on_cpu is not None else None
    if first:
        release = check_version()
        foreign = _foreign_imports()
        if foreign:
            raise MegatronCoreError(
                f"megatron switch: install() must run before megatron is imported; already "
                f"imported from megatron-core: {', '.join(foreign)}"
            )
        _FINDER = MegatronSwitchFinder(SERVED)
        sys.meta_path.insert(0, _FINDER)
        # the allreduce marks of expert parameters follow the served release
        set_expert_grad_rule("0.16" if release.startswith("0.16.") else "0.19")
        te_stand_in.serve()  # NOTE [ Serving the Transformer Engine stand-in ]
        without_te.arm()  # NOTE [ Without Transformer Engine ]
    if want is not None:
        cpu_mode.configure(want)
    # NOTE [ Switch in every process ] in _children.py
    _children.arm(SWITCH_ENV, install, cuda_on_cpu=cpu_mode.is_active())


def uninstall() -> None:
    """Remove the import hook, the Transformer Engine stand-in, the CPU mode and the hand-over to
    child processes. Modules already imported keep the objects they were given."""
    global _FINDER
    cpu_mode.disable()
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None
    _children.disarm()
    without_te.disarm()
    te_stand_in.unserve()
    set_expert_grad_rule("0.19")


def install_from_env() -> bool:
    """:func:`install` if ``MEGATRON_CORE_SWITCH`` is 1/true/yes/on; returns whether it did."""
    if _env_on(SWITCH_ENV):
        install()
        return True
    return False
