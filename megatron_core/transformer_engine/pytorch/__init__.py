"""``transformer_engine.pytorch``: the stand-in's face (NOTE [ Transformer Engine stand-in ]).

Names grouped by the file they come from, as in Transformer Engine's own face (the part
megatron-core uses).
"""

from megatron_core.transformer_engine.pytorch import (
    attention,
    distributed,
    fp8,
    graph,
    module,
    ops,
    quantization,
    router,
    tensor,
    utils,
)
from megatron_core.transformer_engine.pytorch.attention import (
    DotProductAttention,
    RotaryPositionEmbedding,
)
from megatron_core.transformer_engine.pytorch.distributed import CudaRNGStatesTracker, checkpoint
from megatron_core.transformer_engine.pytorch.graph import make_graphed_callables
from megatron_core.transformer_engine.pytorch.module import (
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
    UserBufferQuantizationMode,
    destroy_ub,
    initialize_ub,
)
from megatron_core.transformer_engine.pytorch.quantization import (
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
    quantized_model_init,
)
from megatron_core.transformer_engine.pytorch.tensor import QuantizedTensor
from megatron_core.transformer_engine.pytorch.utils import (
    get_cudnn_version,
    get_device_compute_capability,
    is_bf16_available,
)

__all__ = [
    "attention",
    "distributed",
    "fp8",
    "graph",
    "module",
    "ops",
    "quantization",
    "router",
    "tensor",
    "utils",
]
# From module/: the layers
__all__ += [
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
    "UserBufferQuantizationMode",
    "destroy_ub",
    "initialize_ub",
]
# From attention/: attention and rotary embeddings
__all__ += ["DotProductAttention", "RotaryPositionEmbedding"]
# From quantization.py: the quantization contexts (refused when enabled)
__all__ += [
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "quantized_model_init",
    "get_default_recipe",
    "is_fp8_available",
    "is_mxfp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
]
# From distributed.py: activation checkpointing and the RNG tracker
__all__ += ["checkpoint", "CudaRNGStatesTracker"]
# From graph.py, utils.py and tensor/: refused or type-only names
__all__ += [
    "make_graphed_callables",
    "QuantizedTensor",
    "get_cudnn_version",
    "get_device_compute_capability",
    "is_bf16_available",
]
