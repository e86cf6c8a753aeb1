"""What megatron-core's own modules refuse without Transformer Engine, done by this package:
a table of adapters applied to megatron-core modules as the switch imports them.

# NOTE [ Without Transformer Engine ]
1. :data:`ADAPTERS` maps a megatron-core module to {name: adapter}; when the module is imported
   under the switch (or at ``install()``, if it already was), each adapter is called with the
   module's object of that name and its result replaces it, before any other module imports the
   name. The adapters hold on GPUs and CPUs alike (unlike the CPU mode's, cpu_mode.py).
2. Context parallelism (NOTE [ Context parallelism ]): megatron-core's local
   ``DotProductAttention`` asserts ``context_parallel_size == 1``. Adapted, it is built as at
   CP=1 and, where the config's CP size is above 1, its forward runs
   :func:`~megatron_core.context_parallel.context_parallel_attention` over the CP group
   (``pg_collection.cp``, else parallel_state's), with the layer's ``cp_comm_type`` (else the
   config's, else ``"p2p"``), its softmax scale, causal exactly when the layer's mask type is
   a causal one (causal, padding_causal, causal_bottom_right), and the attention mask it is
   given (megatron-core's [b, 1, s/cp, s], rows cut by ``get_batch_on_this_cp_rank``). At
   CP=1 the forward is megatron-core's own, unchanged. Refused with a clear error (at
   construction or in forward): attention dropout > 0 with ``a2a``, a sliding window
   (``window_size``), packed sequences and attention bias with CP > 1. Attention dropout with
   ``p2p`` / ``all_gather`` draws inside the tracker's fork as megatron-core's own forward does
   (NOTE [ Fused attention ], rule 4).
3. ``rope_utils.get_pos_emb_on_this_cp_rank`` builds its index in pinned host memory and
   copies it to the GPU; it becomes this package's (the same rows, on the table's device).
4. ``megatron.core.jit.jit_fuser`` is ``torch.compile``, applied as a decorator while
   megatron-core imports (activations, norms, attention, the MoE router, the fusions): each
   application loads torch's compiler stack, 1.8 s per process with torch 2.13 and 3.3 s with
   torch 2.6 on a 2-core CPU, paid on every rank although most of these functions never run.
   Adapted, decorating does nothing but wrap: each function goes through ``torch.compile``, with
   the same options, at its first call, as it would have at the first call of the compiled one.
   Only ``torch.compile`` is wrapped (a ``jit_fuser`` megatron-core set otherwise is kept).
5. ``megatron.core.utils.is_te_min_version`` compares ``get_te_version()`` with a version, and
   that is None without Transformer Engine: megatron-core 0.16.1 raises ``TypeError`` there,
   and its unit tests' conftest asks before every test. Adapted, it answers False while
   ``get_te_version()`` is None (as 0.19 and this package's ``megatron_core.utils`` do) and is
   megatron-core's own otherwise; where ``transformer_engine`` can be imported it is not
   adapted at all.
6. :func:`disarm` stops adapting later imports; adapted modules keep their adapters.
   :func:`put_back` also gives back what an adapter replaced (rules 3-5 and 8: a new object in
   the module's place); rules 2 and 7 change megatron-core's class in place and stay. The
   pytest plugin puts back at the end of its session.
7. megatron-core 0.19's ``HybridStack`` (``HybridModel``'s layers) is refused, before it builds
   any layer, when its layer types include one whose kernels are CUDA-only and whose package is
   not importable: Mamba (``M``: mamba-ssm, causal-conv1d) and GatedDeltaNet (``G``:
   flash-linear-attention). The message names the layer type, its symbol and the package;
   attention (``*``), MLP (``-``) and MoE (``E``) layers run on this package (with the
   Transformer Engine stand-in). Where the package imports, the layer is megatron-core's.
8. ``megatron.core.utils.is_fa_min_version`` raises ``ModuleNotFoundError`` without
   flash-attn (megatron-core 0.16.1 and 0.19), which its unit tests ask at collection time
   (``tests/unit_tests/models/test_gpt_model.py``). Adapted, it answers False where
   ``flash_attn`` cannot be imported, as rule 5 does for Transformer Engine; where it can, it
   is megatron-core's own.
"""

from __future__ import annotations

import contextlib
import functools
import sys

from megatron_core.errors import MegatronCoreError
from megatron_core.megatron._finder import PostImportFinder
from megatron_core.megatron.te_stand_in import importable

__all__ = ["ADAPTERS", "arm", "disarm", "put_back"]


def _cp_size_of(config) -> int:
    return int(getattr(config, "context_parallel_size", 1) or 1)


def _context_parallel_attention(cls):
    """Rule 2: megatron-core's DotProductAttention, with context parallelism."""
    original_init, original_forward = cls.__init__, cls.forward

    @functools.wraps(original_init)
    def __init__(self, config, layer_number, *args, **kwargs):
        cp = _cp_size_of(config)
        if cp == 1:
            original_init(self, config, layer_number, *args, **kwargs)
            self._megatron_core_cp = 1
            return
        dropout = kwargs.get("attention_dropout")
        dropout = config.attention_dropout if dropout is None else dropout
        comm = kwargs.get("cp_comm_type") or getattr(config, "cp_comm_type", None) or "p2p"
        if isinstance(comm, (list, tuple)):
            comm = comm[max(1, layer_number) - 1]
        if dropout and comm == "a2a":
            raise MegatronCoreError(
                f"DotProductAttention: attention_dropout ({dropout}) with context_parallel_size "
                f"({cp}) and cp_comm_type 'a2a' is not supported by this package's context "
                "parallelism (NOTE [ Fused attention ], rule 4); set it to 0 or use 'p2p' / "
                "'all_gather'"
            )
        window = getattr(config, "window_size", None)
        if window is not None:
            raise MegatronCoreError(
                f"DotProductAttention: window_size ({window}) (sliding-window attention) with "
                f"context_parallel_size ({cp}) is not supported by this package's context "
                "parallelism"
            )
        config.context_parallel_size = 1  # megatron-core's assert; restored at once
        try:
            original_init(self, config, layer_number, *args, **kwargs)
        finally:
            config.context_parallel_size = cp
        pg_collection = kwargs.get("pg_collection")
        self._megatron_core_cp = cp
        self._megatron_core_cp_comm_type = comm
        self._megatron_core_cp_group = getattr(pg_collection, "cp", None)

    @functools.wraps(original_forward)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):  # fmt: skip
        if getattr(self, "_megatron_core_cp", 1) == 1:
            return original_forward(
                self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                packed_seq_params, **kwargs,
            )  # fmt: skip
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        from megatron_core.context_parallel import context_parallel_attention

        if packed_seq_params is not None or attention_bias is not None:
            raise MegatronCoreError(
                "DotProductAttention with context parallelism: packed sequences and attention "
                "bias are not supported by this package's context parallelism"
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # causal, padding_causal and their bottom-right forms (the same for self-attention)
        causal = "causal" in AttnMaskType(mask_type).name
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # megatron-core's own forward draws its dropout inside the tracker's fork unless the
        # config is sequence parallel: the same stream here
        fork = dropout_p and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            out = context_parallel_attention(
                query, key, value, cp_group=self._megatron_core_cp_group,
                cp_comm_type=self._megatron_core_cp_comm_type, causal=causal,
                softmax_scale=self.softmax_scale, attention_mask=attention_mask,
                dropout_p=dropout_p,
            )  # fmt: skip
        return out.reshape(out.shape[0], out.shape[1], -1)

    cls.__init__, cls.forward = __init__, forward
    return cls


def _pos_emb_on_this_cp_rank(original):
    """Rule 3."""
    from megatron_core.context_parallel import get_pos_emb_on_this_cp_rank

    @functools.wraps(original)
    def get_pos_emb(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        return get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group)

    return get_pos_emb


def _compile_on_first_call(original):
    """Rule 4."""
    import torch

    if original is not torch.compile:
        return original

    @functools.wraps(original)
    def jit_fuser(fn=None, **options):
        if fn is None:  # jit_fuser(mode=...) as a decorator factory
            return lambda function: jit_fuser(function, **options)
        compiled = []

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not compiled:
                compiled.append(original(fn, **options))
            return compiled[0](*args, **kwargs)

        return run

    return jit_fuser


def _answer_without_te(original):
    """Rule 5."""
    import importlib.util

    if importable(importlib.util.find_spec("transformer_engine")):  # real, or the stand-in
        return original
    import megatron.core.utils as megatron_utils

    @functools.wraps(original)
    def is_te_min_version(version, check_equality=True):
        if megatron_utils.get_te_version() is None:
            return False
        return original(version, check_equality)

    return is_te_min_version


def _answer_without_flash_attn(original):
    """Rule 8."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        return original

    @functools.wraps(original)
    def is_fa_min_version(version, check_equality=True):
        return False

    return is_fa_min_version


# Rule 7: layer symbol -> (layer type, the package whose import decides, what to install).
_CUDA_ONLY_LAYERS = {
    "M": ("Mamba", "mamba_ssm", "mamba-ssm and causal-conv1d"),
    "G": ("GatedDeltaNet", "fla", "flash-linear-attention"),
}


def _refuse_cuda_only_layers(cls):
    """Rule 7."""
    import importlib.util

    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, config, submodules, *args, layer_type_list=None, **kwargs):
        for symbol in dict.fromkeys(layer_type_list or ()):
            layer, package, install = _CUDA_ONLY_LAYERS.get(symbol, (None, None, None))
            if layer is not None and importlib.util.find_spec(package) is None:
                raise MegatronCoreError(
                    f"HybridStack: layer type {symbol!r} ({layer}) in layer_type_list "
                    f"{''.join(layer_type_list)!r} needs {install}, whose kernels are CUDA-only "
                    f"(Triton / CUDA) and which is not importable here; this package runs the "
                    f"attention ('*'), MLP ('-') and MoE ('E') layers"
                )
        original_init(self, config, submodules, *args, layer_type_list=layer_type_list, **kwargs)

    cls.__init__ = __init__
    return cls


ADAPTERS: dict[str, dict[str, object]] = {
    "megatron.core.utils": {
        "is_te_min_version": _answer_without_te,
        "is_fa_min_version": _answer_without_flash_attn,
    },
    "megatron.core.jit": {"jit_fuser": _compile_on_first_call},
    "megatron.core.transformer.dot_product_attention": {
        "DotProductAttention": _context_parallel_attention
    },
    "megatron.core.models.common.embeddings.rope_utils": {
        "get_pos_emb_on_this_cp_rank": _pos_emb_on_this_cp_rank
    },
    "megatron.core.models.hybrid.hybrid_block": {"HybridStack": _refuse_cuda_only_layers},
}
_ADAPTED: set[str] = set()  # modules already adapted (once per module object)
_REPLACED: list[tuple[object, str, object, object]] = []  # (module, name, original, adapted)
_FINDER: PostImportFinder | None = None


def _adapt(module) -> None:
    if module.__name__ in _ADAPTED:
        return
    _ADAPTED.add(module.__name__)
    for name, adapter in ADAPTERS.get(module.__name__, {}).items():
        original = getattr(module, name, None)
        if original is not None:
            adapted = adapter(original)
            setattr(module, name, adapted)
            if adapted is not original:
                _REPLACED.append((module, name, original, adapted))


def arm() -> None:
    """Apply :data:`ADAPTERS` to megatron-core modules imported from now on and to those
    already imported (idempotent)."""
    global _FINDER
    if _FINDER is None:
        _FINDER = PostImportFinder(ADAPTERS.__contains__, _adapt)
        sys.meta_path.insert(0, _FINDER)
    for name in ADAPTERS:
        if name in sys.modules:
            _adapt(sys.modules[name])


def disarm() -> None:
    """Stop adapting modules imported later (adapted ones keep their adapters)."""
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None


def put_back() -> None:
    """Rule 6: :func:`disarm`, and give back every object an adapter replaced (where the module
    still holds the adapter's); those modules are adapted again at the next :func:`arm`."""
    disarm()
    while _REPLACED:
        module, name, original, adapted = _REPLACED.pop()
        if getattr(module, name, None) is adapted:
            setattr(module, name, original)
        _ADAPTED.discard(module.__name__)
