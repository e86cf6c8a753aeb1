"""pytest plugin: run a megatron-core test suite on this package, on gloo CPU ranks, with one flag.

Installed as a ``pytest11`` entry point, so pytest always loads it; it does nothing unless asked::

    torchrun --nproc-per-node 8 -m pytest --megatron-core-switch tests/unit_tests/tensor_parallel
    MEGATRON_CORE_SWITCH=1 torchrun --nproc-per-node 8 -m pytest tests/unit_tests/...

(``-p megatron_core.megatron.pytest_plugin`` loads it where entry points are disabled.) Asked, it
1. installs the switch (megatron_core.megatron.install) before any conftest imports megatron, so
   the suite's ``megatron.core.parallel_state`` etc. are this package's;
2. when torch has no CUDA, lets the suite's CUDA-only set-up run on CPU ranks: a process group
   requested with the "nccl" backend is created with gloo, and CUDA's set_device does nothing
   (device.ignore_cuda_set_device). Both are undone at the end of the session.
"""

from __future__ import annotations

import os

SWITCH_FLAG = "--megatron-core-switch"
_UNDO: list = []


def pytest_addoption(parser) -> None:
    group = parser.getgroup("megatron_core")
    group.addoption(
        SWITCH_FLAG,
        action="store_true",
        default=False,
        help="serve megatron.core's parallel_state / tensor_parallel / pipeline_parallel / "
        "configs / finalize_model_grads from megatron_core, on gloo CPU ranks without CUDA "
        "(also: MEGATRON_CORE_SWITCH=1)",
    )


def _asked(early_config) -> bool:
    from megatron_core.megatron import SWITCH_ENV

    # Before the conftests load, only the pre-parsed arguments are there.
    if getattr(early_config.known_args_namespace, "megatron_core_switch", False):
        return True
    return os.environ.get(SWITCH_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _gloo_for_nccl_on_cpu() -> None:
    """Rule 2 of the module doc (only where torch has no CUDA)."""
    import torch.distributed as dist

    from megatron_core import device

    if device.accelerator_count() > 0:
        return
    original_init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if isinstance(backend, str) and backend.lower() == "nccl":
            backend = "gloo"
        return original_init(backend, *args, **kwargs)

    dist.init_process_group = init_process_group
    _UNDO.append(lambda: setattr(dist, "init_process_group", original_init))
    _UNDO.append(device.ignore_cuda_set_device())


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Install before the suite's conftest files import megatron."""
    if not _asked(early_config):
        return
    from megatron_core import megatron

    os.environ[megatron.SWITCH_ENV] = "1"  # processes the suite spawns install it too
    megatron.install()
    _gloo_for_nccl_on_cpu()


def pytest_unconfigure(config) -> None:
    while _UNDO:
        _UNDO.pop()()
