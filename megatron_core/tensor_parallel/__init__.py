"""Tensor parallelism: layers, communication regions, cross entropy, data, RNG, checkpointing.

Mirrors ``megatron.core.tensor_parallel``; each block below re-exports one source file.
"""

# Each section below imports its file's public names and extends __all__ with them, e.g.
# __all__ += ["divide", "split_tensor_along_last_dim"]
__all__: list[str] = []

# --- section: utils.py divide/split/VocabUtility (owner: mappings) ---
# --- end section: utils.py divide/split/VocabUtility ---

# --- section: utils.py 1-D chunks (owner: checkpoint) ---
# --- end section: utils.py 1-D chunks ---

# --- section: mappings.py (owner: mappings) ---
# --- end section: mappings.py ---

# --- section: layers.py (owner: layers) ---
# --- end section: layers.py ---

# --- section: cross_entropy.py (owner: mappings) ---
# --- end section: cross_entropy.py ---

# --- section: data.py (owner: mappings) ---
# --- end section: data.py ---

# --- section: random.py (owner: rng) ---
# --- end section: random.py ---

# --- section: checkpointing.py (owner: checkpoint) ---
# --- end section: checkpointing.py ---

