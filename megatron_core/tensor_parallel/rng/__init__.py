"""The RNG helpers beside ``random.py`` (private; megatron-core has no such module).

``random.py`` keeps the states tracker, the seeding and the RNG snapshots (NOTE [ RNG streams ]);
this family holds what builds on them or feeds them, each file one idea:

* graphs.py: graph-safe generator states, megatron-core's CUDA-graph RNG helpers
  (``convert_cuda_rng_state``, ``is_graph_safe_cuda_rng_tracker``; re-exported by ``random.py``,
  megatron-core's path).
* state.py: the RNG stream audit across ranks (``audit_rng_streams``) and the per-rank RNG state
  save/load for an exact resume (``get_rng_state_dict`` / ``set_rng_state_dict``; re-exported by
  the ``tensor_parallel`` face).

This face imports nothing: ``random.py`` imports graphs.py and state.py imports ``random.py``, so
a face importing both would close an import cycle through ``random.py``.
"""

__all__: list[str] = []
