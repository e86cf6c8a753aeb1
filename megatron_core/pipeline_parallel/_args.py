"""What every schedule does around its microbatches: argument checks (before any p2p), the
exchanged shape, the groups it runs over, grad-sync suppression and the final grad reduction."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

from megatron_core import consistency, parallel_state
from megatron_core.errors import MegatronCoreError
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator

__all__ = ["get_tensor_shapes"]


def one_iteration(schedule: Callable) -> Callable:
    """Decorate a ``forward_backward_func``: each call is one iteration of the check window
    (NOTE [ Check window ], rule 1), an evaluation one when ``forward_only``."""

    @functools.wraps(schedule)
    def marked(*args, **kwargs):
        with consistency.iteration("eval" if kwargs.get("forward_only") else "train"):
            return schedule(*args, **kwargs)

    return marked


def option(config, name: str, default=None):
    """A schedule option of ``config``, or megatron-core's default when the config lacks it."""
    return getattr(config, name, default)


def tensor_shape(seq_length, micro_batch_size, decoder_seq_length, config, tp_size, cp_size):
    """(s / cp (/ tp under SP), micro_batch_size, hidden), s the decoder length if given."""
    s = decoder_seq_length if decoder_seq_length is not None else seq_length
    s //= cp_size
    if option(config, "sequence_parallel", False):
        s //= tp_size
    return (s, micro_batch_size, config.hidden_size)


def get_tensor_shapes(
    *,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    config,
    tp_group=None,
    cp_group=None,
) -> list[tuple[int, int, int]]:
    """The shapes sent between stages: ``[(s / cp_size (/ tp_size under sequence parallelism),
    micro_batch_size, hidden_size)]``, where s is ``decoder_seq_length`` when given, else
    ``seq_length``. A None group (megatron-core 0.19's default) is parallel_state's."""
    if tp_group is None or cp_group is None:
        default_tp, default_cp = parallel_groups(None)
        tp_group = default_tp if tp_group is None else tp_group
        cp_group = default_cp if cp_group is None else cp_group
    tp_size, cp_size = tp_group.size(), cp_group.size()
    return [
        tensor_shape(seq_length, micro_batch_size, decoder_seq_length, config, tp_size, cp_size)
    ]


def one_chunk(value, name: str):
    """The single model / iterator of a non-interleaved schedule (a 1-element list is unwrapped)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise MegatronCoreError(
                f"pipeline schedule: non-interleaved schedules take one {name}, got a list of "
                f"{len(value)} (interleaving needs virtual_pipeline_model_parallel_size)"
            )
        return value[0]
    return value


def check_schedule_args(
    *, num_microbatches, seq_length, micro_batch_size, config, pp_size: int, tp_size: int = 1
) -> None:
    """Raise MegatronCoreError for arguments no schedule can run, before any communication."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise MegatronCoreError(
            f"pipeline schedule: num_microbatches ({num_microbatches!r}) must be an int"
        )
    if num_microbatches < 1:
        raise MegatronCoreError(
            f"pipeline schedule: num_microbatches ({num_microbatches}) must be >= 1"
        )
    if pp_size == 1:
        return
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MegatronCoreError(f"pipeline schedule: {name} ({value!r}) must be an int >= 1")
    if option(config, "pipeline_dtype") is None:
        raise MegatronCoreError(
            f"pipeline schedule: config.pipeline_dtype must be set when the pipeline size "
            f"({pp_size}) > 1"
        )
    if option(config, "hidden_size") is None:
        raise MegatronCoreError("pipeline schedule: config.hidden_size is needed for the p2p shape")
    if option(config, "sequence_parallel", False) and seq_length % tp_size:
        raise MegatronCoreError(
            f"pipeline schedule: seq_length ({seq_length}) must be divisible by the "
            f"tensor-parallel size ({tp_size}) under sequence parallelism"
        )


def communicator(p2p_communicator, pg_collection, config) -> P2PCommunicator:
    """The given communicator, or one over the collection's / parallel_state's pp group."""
    if p2p_communicator is not None:
        return p2p_communicator
    group = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    if group is None:
        group = parallel_state.get_pipeline_model_parallel_group()
    return P2PCommunicator(group, config)


def parallel_groups(pg_collection) -> tuple:
    """(tp group, cp group) from the collection or parallel_state."""
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if tp is None:
        tp = parallel_state.get_tensor_model_parallel_group()
    if cp is None:
        cp = parallel_state.get_context_parallel_group()
    return tp, cp


def parallel_sizes(pg_collection) -> tuple[int, int]:
    """(tp size, cp size) from the collection or parallel_state."""
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    tp_size = tp.size() if tp is not None else parallel_state.get_tensor_model_parallel_world_size()
    cp_size = cp.size() if cp is not None else parallel_state.get_context_parallel_world_size()
    return tp_size, cp_size


def no_sync_context(config) -> Callable[[], contextlib.AbstractContextManager]:
    """``config.no_sync_func`` (DDP's grad-sync suppression; a list: one per chunk, all entered)
    or a null context."""
    func = option(config, "no_sync_func")
    if isinstance(func, list):

        def all_chunks():
            stack = contextlib.ExitStack()
            for chunk_func in func:
                stack.enter_context(chunk_func())
            return stack

        return all_chunks
    return func or contextlib.nullcontext


def _accepts(func: Callable, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def finalize(
    config, model: list, num_tokens, forward_only: bool, pg_collection=None, force_all_reduce=False
):
    """Call ``config.finalize_model_grads_func(model, num_tokens, pg_collection=...,
    force_all_reduce=...)`` after a training pass, as megatron-core does (the keywords only
    when the function takes them: an older two-argument function still works)."""
    func = option(config, "finalize_model_grads_func")
    if func is None or forward_only:
        return
    per_token = option(config, "calculate_per_token_loss", False)
    keywords = {"pg_collection": pg_collection, "force_all_reduce": force_all_reduce}
    keywords = {k: v for k, v in keywords.items() if _accepts(func, k)}
    func(model, num_tokens if per_token else None, **keywords)
