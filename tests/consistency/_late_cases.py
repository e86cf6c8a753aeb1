"""Disagreements between the ranks of a TP group, run after three marked iterations (helper of
test_after_the_window.py and scripts/checks/check_disagreement_after_window.py).

Each case is one way users make the ranks disagree -- shapes, dtypes, keys, vocabulary ranges,
sequence splits, recompute inputs -- written for an initialized parallel_state with world size
= TP; the last rank is the one that differs. :func:`run_case` is the per-rank body: it marks
three agreeing training iterations (the default window closes), then runs the case inside a
fourth, either as the iteration's first collective on the TP group (``"head"``) or after an
agreeing one (``"mid"``), in the default mode or with every check off (``"off"``: what the
package did after the window before the digest). It returns what happened on this rank.

Known outcomes after the window other than an error on every rank: :data:`ABORTS` (sizes that
differ in an all-reduce, all-gather or reduce-scatter that is not an iteration's first
collective make gloo abort the process; an exchange per collective, check mode, is what
prevents that), :data:`SOME_RANKS` and :data:`NAMED_WAITS` (a timeout names the collective).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_core import ModelParallelConfig, consistency, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    model_parallel_cuda_manual_seed,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron_core.tensor_parallel.data import broadcast_data
from megatron_core.tensor_parallel.utils import gather_split_1d_tensor

GROUP_TIMEOUT_MIN = 0.05  # 3 s: a collective one rank never enters ends in a named error
PEER_DEADLINE_S = 3.0  # the package's own waits (NOTE [ Peer deadline ]) end as soon


def _last() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _group():
    return parallel_state.get_tensor_model_parallel_group()


def _config(tp, **kwargs):
    return ModelParallelConfig(tensor_model_parallel_size=tp, **kwargs)


def _shape(value):
    return [tuple(value.shape)] if isinstance(value, torch.Tensor) else value


# --- shapes ------------------------------------------------------------------------------------


def reduce_rows_4_vs_3(tp):
    return reduce_from_tensor_model_parallel_region(torch.ones(3 if _last() else 4, 2))


def reduce_2x3_vs_3x2(tp):  # as many elements: gloo sums them
    return reduce_from_tensor_model_parallel_region(torch.ones((3, 2) if _last() else (2, 3)))


def gather_last_dim_3_vs_5(tp):
    return gather_from_tensor_model_parallel_region(torch.ones(4, 5 if _last() else 3))


def gather_4x3_vs_3x4(tp):  # as many elements: gloo mixes the bytes
    return gather_from_tensor_model_parallel_region(torch.ones((3, 4) if _last() else (4, 3)))


def sequence_gather_4_vs_2(tp):
    return gather_from_sequence_parallel_region(torch.ones(2 if _last() else 4, 2))


def sequence_reduce_scatter_last_dim(tp):
    return reduce_scatter_to_sequence_parallel_region(torch.ones(4 * tp, 3 if _last() else 2))


def split_1d_chunks_3_vs_5(tp):
    return gather_split_1d_tensor(torch.ones(5 if _last() else 3), group=_group())


def split_1d_numel_6_vs_5(tp):  # the chunks are as large: the outputs would differ
    numel = 5 if _last() else 6
    return gather_split_1d_tensor(torch.ones(-(-numel // tp)), group=_group(), numel=numel)


def _pair(tp, sequence_parallel=False):
    config = _config(tp, sequence_parallel=sequence_parallel)
    column = ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.normal_)
    row = RowParallelLinear(
        16, 8, config=config, init_method=torch.nn.init.normal_, input_is_parallel=True,
        skip_bias_add=False, bias=False,
    )  # fmt: skip
    return column, row


def column_row_batch_4_vs_3(tp):  # a data loader that gave one rank a shorter batch
    column, row = _pair(tp)
    x = torch.ones(3 if _last() else 4, 8, requires_grad=True)
    out = row(torch.nn.functional.gelu(column(x)[0]))[0]
    out.sum().backward()
    return out


def column_row_2x4_vs_4x2(tp):  # as many tokens, cut into another [s, b]
    column, row = _pair(tp)
    x = torch.ones((4, 2, 8) if _last() else (2, 4, 8), requires_grad=True)
    out = row(torch.nn.functional.gelu(column(x)[0]))[0]
    out.sum().backward()
    return out


# --- dtypes ------------------------------------------------------------------------------------


def reduce_f32_vs_f64(tp):
    dtype = torch.float64 if _last() else torch.float32
    return reduce_from_tensor_model_parallel_region(torch.ones(3, dtype=dtype))


def gather_f32_vs_f64(tp):
    dtype = torch.float64 if _last() else torch.float32
    return gather_from_tensor_model_parallel_region(torch.ones(4, 3, dtype=dtype))


def gather_f32_vs_f16(tp):  # f16 [4, 6] has the bytes of f32 [4, 3]
    shape, dtype = ((4, 6), torch.float16) if _last() else ((4, 3), torch.float32)
    return gather_from_tensor_model_parallel_region(torch.ones(shape, dtype=dtype))


def _broadcast(tp, keys, datatype, data_keys=("a", "b")):
    data = None
    if dist.get_rank() == 0:
        data = {key: torch.arange(3 + i).to(datatype) for i, key in enumerate(data_keys)}
    return broadcast_data(keys, data, datatype)


def broadcast_f32_vs_i64(tp):
    return _broadcast(tp, ["a"], torch.int64 if _last() else torch.float32)


def broadcast_i64_vs_f64(tp):
    return _broadcast(tp, ["a"], torch.float64 if _last() else torch.int64)


def layer_input_f64_every_rank(tp):  # the same bad dtype everywhere: each rank's own check
    column, _ = _pair(tp, sequence_parallel=tp > 1)
    return column(torch.ones(2, 1, 8, dtype=torch.float64))[0]


def layer_input_f64_one_rank(tp):  # under sequence parallelism the input is gathered first
    column, _ = _pair(tp, sequence_parallel=tp > 1)
    return column(torch.ones(2, 1, 8, dtype=torch.float64 if _last() else torch.float32))[0]


# --- keys --------------------------------------------------------------------------------------


def broadcast_keys_2_vs_1(tp):
    return _broadcast(tp, ["a"] if _last() else ["a", "b"], torch.int64)


def broadcast_key_names(tp):
    keys = ["a", "c"] if _last() else ["a", "b"]
    return _broadcast(tp, keys, torch.int64, data_keys=("a", "b", "c"))


# --- vocabulary ranges -------------------------------------------------------------------------


def _embedding(tp, vocab=None):
    config = _config(tp)
    vocab = 4 * tp if vocab is None else vocab
    return VocabParallelEmbedding(vocab, 3, init_method=torch.nn.init.normal_, config=config)


def embedding_ids_outside(tp):  # the same ids everywhere: each rank's own range check
    return _embedding(tp)(torch.tensor([[0, 4 * tp + 1, -1]]))


def embedding_ids_differ(tp):  # in range, but not the same ids: each rank embeds its own
    ids = torch.tensor([[0, 1, 3 if _last() else 2]])
    return _embedding(tp)(ids)


def embedding_vocab_split_differs(tp):  # one rank computed its vocabulary size itself
    return _embedding(tp, vocab=6 * tp if _last() else 4 * tp)(torch.tensor([[0, 1, 2]]))


def _logits(rows, partition):
    return torch.randn(rows, partition, generator=torch.Generator().manual_seed(0))


def ce_target_outside_one_rank(tp):
    target = torch.tensor([0, 1, 4 * tp + 3 if _last() else 2])
    return vocab_parallel_cross_entropy(_logits(3, 4), target)


def ce_targets_differ(tp):
    return vocab_parallel_cross_entropy(_logits(3, 4), torch.tensor([0, 1, 3 if _last() else 2]))


def ce_vocab_shard_4_vs_6(tp):
    return vocab_parallel_cross_entropy(_logits(3, 6 if _last() else 4), torch.tensor([0, 1, 2]))


def ce_batch_3_vs_5(tp):
    rows = 5 if _last() else 3
    return vocab_parallel_cross_entropy(_logits(rows, 4), torch.zeros(rows, dtype=torch.long))


# --- sequence splits ---------------------------------------------------------------------------


def sequence_split_indivisible(tp):  # the same odd length everywhere: each rank's own check
    return scatter_to_sequence_parallel_region(torch.ones(2 * tp + 1, 3))


def sequence_reduce_scatter_indivisible_one_rank(tp):
    return reduce_scatter_to_sequence_parallel_region(torch.ones(2 * tp + (1 if _last() else 0), 2))


def sequence_parallel_pair_lengths_differ(tp):  # each rank's [s / tp] chunk, one rank longer
    column, row = _pair(tp, sequence_parallel=True)
    x = torch.ones(3 if _last() else 2, 1, 8, requires_grad=True)
    out = row(torch.nn.functional.gelu(column(x)[0]))[0]
    out.sum().backward()
    return out


# --- recompute inputs --------------------------------------------------------------------------


def checkpoint_input_differs(tp):
    linear = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4 * tp)
    if _last():
        x[1, 2] = 2.0  # the recompute would use the other ranks' chunks of their own input
    out = checkpoint(lambda t: linear(t.view(-1, 4)), True, x.requires_grad_())
    out.sum().backward()
    return out


def checkpoint_backward_one_rank(tp):
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4 * tp, requires_grad=True)
    out = checkpoint(lambda t: linear(t.view(-1, 4)), True, x)
    if not _last():
        out.sum().backward()  # gathers the distributed input: a collective
    else:  # the last rank skips backward and goes on to its next collective
        reduce_from_tensor_model_parallel_region(torch.ones(2))
    return out


CASES = {
    f.__name__: f
    for f in (
        reduce_rows_4_vs_3, reduce_2x3_vs_3x2, gather_last_dim_3_vs_5, gather_4x3_vs_3x4,
        sequence_gather_4_vs_2, sequence_reduce_scatter_last_dim, split_1d_chunks_3_vs_5,
        split_1d_numel_6_vs_5, column_row_batch_4_vs_3, column_row_2x4_vs_4x2,
        reduce_f32_vs_f64, gather_f32_vs_f64, gather_f32_vs_f16, broadcast_f32_vs_i64,
        broadcast_i64_vs_f64, layer_input_f64_every_rank, layer_input_f64_one_rank,
        broadcast_keys_2_vs_1, broadcast_key_names, embedding_ids_outside, embedding_ids_differ,
        embedding_vocab_split_differs, ce_target_outside_one_rank, ce_targets_differ,
        ce_vocab_shard_4_vs_6, ce_batch_3_vs_5, sequence_split_indivisible,
        sequence_reduce_scatter_indivisible_one_rank, sequence_parallel_pair_lengths_differ,
        checkpoint_input_differs, checkpoint_backward_one_rank,
    )
}  # fmt: skip

# Where a case ends in the default mode after the window other than an error on every rank
# (scripts/checks/check_disagreement_after_window.py counts them). As the iteration's first
# collective on the group ("head") every case raises on every rank, except the two marked "both".
SOME_RANKS = {  # the rank that differs raises alone; its peers wait until a timeout names it
    "layer_input_f64_one_rank": "the last rank's own dtype check (both)",
    "sequence_reduce_scatter_indivisible_one_rank": "the last rank's own split check",
}
NAMED_WAITS = {  # every rank waits until a timeout names the collective
    "reduce_rows_4_vs_3": "gloo completes rank 0's all-reduce of 8 elements and leaves rank 1's "
    "of 6 waiting; rank 0 then waits in the digest",
    "checkpoint_backward_one_rank": "one rank skips a backward: its peers' gather never meets "
    "it (both)",
}
ABORTS = {  # gloo aborts the process: sizes that differ in a collective that is no head
    "gather_last_dim_3_vs_5": "all-gather of [4, 3] against [4, 5]",
    "sequence_gather_4_vs_2": "all-gather of [4, 2] against [2, 2]",
    "sequence_reduce_scatter_last_dim": "reduce-scatter of [8, 2] against [8, 3]",
    "split_1d_chunks_3_vs_5": "all-gather of 3 against 5 elements",
    "column_row_batch_4_vs_3": "Row's all-reduce of [4, 8] against [3, 8]",
    "reduce_f32_vs_f64": "all-reduce of 12 against 24 bytes",
    "gather_f32_vs_f64": "all-gather of 48 against 96 bytes",
    "broadcast_keys_2_vs_1": "broadcast_data's header of 22 against 13 values",
    "sequence_parallel_pair_lengths_differ": "Column's all-gather of [2, 1, 8] against [3, 1, 8]",
}
DIGEST = {  # raised on every rank by the iteration's digest, where the collective ran unseen
    "reduce_2x3_vs_3x2", "gather_4x3_vs_3x4", "split_1d_numel_6_vs_5", "column_row_2x4_vs_4x2",
    "gather_f32_vs_f16", "embedding_ids_differ", "embedding_vocab_split_differs",
    "ce_targets_differ", "checkpoint_input_differs",
}  # fmt: skip


def expected(name: str, position: str) -> str:
    """The outcome (as :func:`classify` names it) of ``name`` in the default mode."""
    both = "(both)" in SOME_RANKS.get(name, "") + NAMED_WAITS.get(name, "")
    if position == "head" and not both:
        return "every rank"
    if name in SOME_RANKS:
        return "some ranks, the others named"
    if name in NAMED_WAITS:
        return "named wait"
    if name in ABORTS:
        return "abort"
    return "every rank (digest)" if name in DIGEST else "every rank"


def classify(results) -> str:
    """One word for what every rank's :func:`run_case` result says happened."""
    kinds = [r[0] for r in results]
    if all(k == "returned" for k in kinds):
        return "silent"  # every case is a disagreement: nothing flagged it
    errors = [r for r in results if r[0] == "error"]
    clear = [r for r in errors if r[2] and r[1] not in ("CollectiveError", "PeerDeadlineError")]
    if len(clear) == len(results) and len({r[3] for r in clear}) == 1:
        return "every rank (digest)" if clear[0][4] == "digest" else "every rank"
    if clear and len(errors) == len(results):
        return "some ranks, the others named"  # the rest: a timeout naming the collective
    if clear:
        return "some ranks, the others returned"
    if errors and len(errors) == len(results):
        return "named wait"
    if errors:  # a timeout named the collective on some ranks; the others went on with it
        return "named on some ranks, the others returned"
    return "other: " + "; ".join(f"{r[1]}: {r[3][:80]}" for r in errors)


def _agreeing(tp):
    """An agreeing collective on each group the cases use (TP, and WORLD)."""
    reduce_from_tensor_model_parallel_region(torch.ones(2))
    consistency.checked_all_reduce("world probe", torch.ones(1))


def run_case(name: str, position: str, mode: str, tp: int):
    """The per-rank body (module doc): ``position`` "head" or "mid", ``mode`` "default" or
    "off". Returns ("error", type name, is a package error, message, where, seconds) or
    ("returned", value's shapes, seconds); ``where`` is "digest" for the iteration's digest."""
    consistency.set_peer_deadline(PEER_DEADLINE_S)  # every rank alike; the harness resets it
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, distributed_timeout_minutes=GROUP_TIMEOUT_MIN
    )
    model_parallel_cuda_manual_seed(1)
    with consistency.check_mode(consistency.CheckMode.WINDOW):
        for _ in range(3):
            with consistency.iteration():
                _agreeing(tp)
        if mode == "off":
            consistency.set_mode("off", restart_windows=False)
        start = time.monotonic()
        try:
            with consistency.iteration():
                if position == "mid":
                    _agreeing(tp)
                value = CASES[name](tp)
        except consistency.CollectiveError as exc:  # a peer never came: named, group broken
            return "error", type(exc).__name__, True, str(exc), "collective", _since(start)
        except Exception as exc:
            where = "digest" if str(exc).startswith("the iteration digest") else "collective"
            package = isinstance(exc, MegatronCoreError)
            return "error", type(exc).__name__, package, str(exc), where, _since(start)
    return "returned", _shape(value), _since(start)


def _since(start: float) -> float:
    return round(time.monotonic() - start, 2)
