"""Context parallelism without Transformer Engine: the sequence split over the context-parallel
(CP) group, and core attention whose keys come from every CP rank.

# NOTE [ Context parallelism ]
1. Layout. A sequence of length s is cut into 2 * cp equal chunks; CP rank r holds chunks r and
   2 * cp - 1 - r, in that order (megatron-core's split: under a causal mask every rank then has
   the same amount of work, one early and one late chunk). :func:`cp_positions` gives a rank's
   positions; :func:`split_for_context_parallel` / :func:`get_batch_on_this_cp_rank` /
   :func:`get_pos_emb_on_this_cp_rank` cut tensors, batches and position tables that way, and
   :func:`gather_from_context_parallel` puts the parts back in sequence order. Masks are decided
   by these global positions, never by local indices, so every algorithm below masks exactly as
   the unsplit sequence would.
2. The three algorithms (``cp_comm_type``, megatron-core's names), all over the CP group:

   - ``all_gather``: K and V are all-gathered, this rank's queries attend to every key; in
     backward K and V are gathered again and the dK / dV every rank computed for every block are
     summed onto their owners by a reduce-scatter (in fp32).
   - ``p2p`` (ring): K and V blocks travel round the ring, rank r -> r + 1, each step's send and
     receive started before that step's block is computed (isend / irecv: the communication
     hides behind the compute); the partial results of the blocks are merged by their
     log-sum-exp. In backward the blocks travel again, each with the fp32 sums of its dK and dV,
     and come home after a full turn.
   - ``a2a`` (Ulysses): one all-to-all turns [s/cp, all heads] into [s, heads/cp] for Q, K and
     V, attention runs on whole sequences of a head subset, and one all-to-all turns the output
     back; heads (and K/V heads) must divide by cp.
3. Numerics and memory. Each block runs on the attention core's block ops (NOTE [ Fused
   attention ], rule 3): torch's fused forward op that returns the block's log-sum-exp (the CPU
   flash kernel, CUDA's memory-efficient kernel), and its backward op given the row's merged
   output and log-sum-exp; where they cannot run (dropout, another device or dtype,
   ``backend="unfused"``) the block is computed unfused in fp32. The log-sum-exp merges and the
   dK / dV sums are fp32 also under autocast (fp64 for fp64 inputs); outputs are cast to the
   query's dtype. Backward never keeps a score matrix: each saves its inputs (this rank's Q, K,
   V), the output and the log-sum-exp (b x h x s/cp), and recomputes each block; the softmax
   gradient of a block needs only the row's log-sum-exp and rowsum(dO * O). So a rank's saved
   bytes are O(s/cp), not O(s^2): per rank Q, K, V and the output are s/cp x b x h x d each.
4. Masks: causal (by global positions), and/or a boolean ``attention_mask`` of megatron-core's
   form [b or 1, 1, s/cp, s] (this rank's query rows, every key in sequence order: a padding
   mask, an arbitrary one); each block takes its columns by the keys' global positions (a2a
   first all-gathers the rows). The causal ring skips the half of an off-diagonal block that
   the causal mask hides (rule 2's chunks make it exactly half); all_gather splits each of the
   rank's two query chunks into the chunks before it (seen whole) and itself (causal), so no
   block needs a position mask; a2a sorts the gathered sequence into order and runs the core.
5. Dropout (NOTE [ Fused attention ], rule 4): p2p and all_gather draw one seed per call from
   the current generator and each block's mask from it, again in backward. a2a refuses it.
6. Not supported (a clear error before any collective): other ``cp_comm_type`` values
   (megatron-core's hierarchical ``a2a+p2p``), packed (THD) sequences and 0.19's hybrid CP,
   attention dropout with a2a, sliding windows, and a local length that is odd.
"""

from megatron_core.context_parallel.attention import CP_COMM_TYPES, context_parallel_attention
from megatron_core.context_parallel.split import (
    cp_positions,
    gather_from_context_parallel,
    get_batch_on_this_cp_rank,
    get_pos_emb_on_this_cp_rank,
    split_for_context_parallel,
)

__all__ = [
    "CP_COMM_TYPES",
    "context_parallel_attention",
    "cp_positions",
    "split_for_context_parallel",
    "gather_from_context_parallel",
    "get_batch_on_this_cp_rank",
    "get_pos_emb_on_this_cp_rank",
]
