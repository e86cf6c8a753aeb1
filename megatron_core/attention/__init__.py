"""Core attention on torch's fused kernels: what our GPT's core attention, every block of
context-parallel attention and the Transformer Engine stand-in's ``DotProductAttention`` call.

# NOTE [ Fused attention ]
1. One core. :func:`dot_product_attention` takes [s, b, h, d] query, key and value (fewer K/V
   heads for grouped-query attention), causal masking (top-left aligned) and / or a bool mask of
   megatron-core's form (True = masked out, broadcastable to [b, h, sq, sk]), a softmax scale
   and dropout, and returns [sq, b, h, d]. It runs ``F.scaled_dot_product_attention``, whose
   fused kernels (flash, memory-efficient, cuDNN on CUDA; flash on the CPU) keep no [sq, sk]
   score matrix: saved bytes are linear in the sequence (the 5as/h term of Korthikanti et al.'s
   per-layer activation formula is gone).
2. Fallback, named. Where torch would run its unfused "math" composite for the inputs (the
   selector ``compat.sdpa_kernel`` asks it first), the core runs this package's own unfused
   computation instead (``unfused.unfused_attention``: the scores materialized, fp32 softmax,
   dropout on the probabilities), and logs once per place and reason, at WARNING, why (on the
   CPU: dropout, which torch's CPU flash kernel lacks). ``backend="unfused"`` (``--attention-
   backend unfused``) runs it on purpose, ``backend="fused"`` raises instead of falling back;
   ``MEGATRON_CORE_ATTENTION_DEBUG=1`` logs every distinct choice; :func:`kernels_used`
   counts them. A row whose keys are all masked gets zeros on every path.
3. Blocks with their log-sum-exp. Context parallelism computes a rank's queries against one
   block of keys at a time and merges the blocks by their log-sum-exp (NOTE [ Context
   parallelism ]). :class:`AttentionBlocks` runs each block on torch's fused forward op that
   returns the lse (the CPU flash kernel, CUDA's memory-efficient kernel:
   ``compat.fused_attention_block_ops``) and its backward with the row's merged output and lse,
   which is exactly what the ring's backward needs. Merges and dK / dV sums stay fp32. Where the
   ops cannot run (another device, a dtype they lack, dropout) the blocks run unfused in fp32.
4. Dropout and the RNG streams (NOTE [ RNG streams ]). The core draws from the current device
   generator, so the caller's fork decides the stream: split heads draw inside
   ``get_cuda_rng_tracker().fork()`` (different TP ranks, different masks; data-parallel
   replicas, the same). A checkpoint's recompute restores the generator states, so it draws the
   same mask: on the CPU the unfused path's dropout draws from the fork's stream (or the
   kept-apart device stream), on CUDA the fused kernel's Philox seed and offset come from the
   CUDA generator's state, which the fork and the recompute restore. Context-parallel blocks
   (p2p, all_gather) draw one seed per call from the current generator and each block's mask from
   that seed, the CP rank and the block (``unfused.block_keep``): the backward draws the same
   mask again instead of keeping it. a2a runs the core on a head subset per CP rank with the same
   stream on every CP rank, so its masks would repeat across ranks: refused by name.
"""

from megatron_core.attention.blocks import AttentionBlocks
from megatron_core.attention.choice import (
    ATTENTION_BACKENDS,
    KernelChoice,
    check_backend,
    kernels_used,
)
from megatron_core.attention.core import check_attention_inputs, dot_product_attention
from megatron_core.attention.unfused import unfused_attention

__all__ = [
    # blocks.py
    "AttentionBlocks",
    # choice.py
    "ATTENTION_BACKENDS",
    "KernelChoice",
    "check_backend",
    "kernels_used",
    # core.py
    "check_attention_inputs",
    "dot_product_attention",
    # unfused.py
    "unfused_attention",
]
