"""megatron_core: a Megatron-style tensor-parallel core for PyTorch.

Import path mirrors megatron-core: ``megatron_core.parallel_state`` and
``megatron_core.tensor_parallel`` stand in for ``megatron.core.parallel_state`` and
``megatron.core.tensor_parallel``.
"""

from megatron_core import device, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.model_parallel_config import ModelParallelConfig

__version__ = "0.1.0"

__all__ = [
    # errors.py
    "MegatronCoreError",
    # model_parallel_config.py
    "ModelParallelConfig",
    # submodules
    "device",
    "parallel_state",
]
