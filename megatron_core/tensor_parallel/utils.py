"""Pure tensor math for tensor parallelism (no autograd classes, no modules).

Two owners write this file; each edits only its own section.
"""

# --- section: divide / split / VocabUtility (owner: mappings) ---
# --- end section: divide / split / VocabUtility ---

# --- section: 1-D chunks (owner: checkpoint) ---
# --- end section: 1-D chunks ---
