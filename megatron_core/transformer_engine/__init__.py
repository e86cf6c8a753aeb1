"""Transformer Engine's PyTorch API, the part megatron-core uses, in pure torch.

megatron-core's Transformer Engine layer spec (``get_gpt_layer_with_transformer_engine_spec``,
0.19's ``hybrid_stack_spec``, Megatron-LM's default ``--transformer-impl``) builds its layers as
subclasses of ``transformer_engine.pytorch`` modules. Transformer Engine has no CPU build and
needs a CUDA toolchain; this package provides those modules on this package's tensor-parallel
layers, attention core and context parallelism, with Transformer Engine's parameter names and
state-dict entries. The megatron switch serves it as the top-level module ``transformer_engine``
where no real Transformer Engine is importable (``megatron/te_stand_in.py``, NOTE [ Serving the
Transformer Engine stand-in ]); nothing imports it otherwise.

# NOTE [ Transformer Engine stand-in ]
1. Paths. Every module megatron-core imports from Transformer Engine has a module here at the
   same path below ``megatron_core.transformer_engine`` (``pytorch.module.base``,
   ``pytorch.distributed``, ``pytorch.fp8``, ``pytorch.attention.rope``, ``common.recipe``, ...).
   A path that megatron-core imports inside ``try`` (``pytorch.permutation``,
   ``pytorch.cross_entropy``, ``pytorch.optimizers``, ``pytorch.cpu_offload``,
   ``pytorch.cpp_extensions``) is absent on purpose: megatron-core then takes its own torch path.
2. Version. :data:`__version__` is ``"2.11.0"``: the newest release megatron-core 0.16.1 declares
   (``transformer-engine>=2.9.0a0,<2.12.0``), and one for which 0.19.2 takes its present-day
   code paths (keyword ``checkpoint``, ``attention.rope`` with interleaving and THD, GQA,
   ``num_splits``) without those of 2.12-2.14 that need what the stand-in does not do (single
   grouped weights, the op fuser's grouped MLP, padded fused permutation). At 2.7 and above
   megatron-core imports ``pytorch.router`` unconditionally, so it exists (its fused kernels
   are refused by name, rule 5).
3. Precision. Modules compute in their parameters' dtype, or in ``torch.autocast``'s dtype
   inside an autocast region (Transformer Engine's activation dtype); norms and softmax
   accumulate in fp32 as torch's kernels do. Nothing is quantized.
4. Parameters and state. Names, registration order and shapes are Transformer Engine's
   (``weight``/``bias``, ``layer_norm_weight``/``layer_norm_bias``, ``weight{i}``/``bias{i}``,
   ``fc1_weight``...), with its tensor-parallel attributes; every module derived from
   ``TransformerEngineBaseModule`` and each norm carries ``_extra_state`` (NOTE [ Extra state
   of Transformer Engine modules ] in ``pytorch/module/base.py``).
5. Refusals. What is not done raises :class:`~megatron_core.errors.MegatronCoreError` naming the
   feature, where it is asked for, on every rank alike (construction arguments or an enabled
   context, before any collective of the module): FP8 / MXFP8 / FP4 recipes (``autocast``,
   ``fp8_autocast``, ``fp8_model_init``, ``quantized_model_init`` enabled), userbuffers
   (``ub_*`` options, ``initialize_ub``), the op fuser (``pytorch.ops``), CUDA graphs of
   Transformer Engine modules (``pytorch.graph``), the fused MoE router kernels, delayed weight
   gradients, symmetric-memory all-reduce, and attention features the attention core lacks
   (THD packing, attention bias, ALiBi, softmax offsets).
"""

from megatron_core.transformer_engine import common, pytorch

__version__ = "2.11.0"

__all__ = ["__version__", "common", "pytorch"]
