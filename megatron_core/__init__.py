"""megatron_core: a Megatron-style tensor-parallel core for PyTorch.

Import path mirrors megatron-core: ``megatron_core.parallel_state`` and
``megatron_core.tensor_parallel`` stand in for ``megatron.core.parallel_state`` and
``megatron.core.tensor_parallel``.
"""

from megatron_core import compat, device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig

__version__ = "0.1.0"

# setup.py's floor, checked where a torch was installed around it (a clear error, not a later
# failure deep inside torch).
compat.require_torch("megatron_core", *compat.FLOOR)

__all__ = [
    # errors.py
    "MegatronCoreError",
    # model_parallel_config.py
    "ModelParallelConfig",
    # submodules
    "device",
    "parallel_state",
]
