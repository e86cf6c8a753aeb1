"""Tensor parallelism: layers, communication regions, cross entropy, data, RNG, checkpointing.

Mirrors ``megatron.core.tensor_parallel``; each block below re-exports one source file.
"""

# --- section: utils.py (owner: layers) ---
# --- end section: utils.py ---

# --- section: mappings.py (owner: layers) ---
# --- end section: mappings.py ---

# --- section: layers.py (owner: layers) ---
# --- end section: layers.py ---

# --- section: cross_entropy.py (owner: layers) ---
# --- end section: cross_entropy.py ---

# --- section: data.py (owner: layers) ---
# --- end section: data.py ---

# --- section: random.py (owner: rng) ---
# --- end section: random.py ---

# --- section: checkpointing.py (owner: checkpoint) ---
# --- end section: checkpointing.py ---

__all__: list[str] = []
# Each section above extends __all__ with its names, e.g.
# __all__ += ["divide", "split_tensor_along_last_dim"]
