"""Training a GPT end to end: arguments, byte-level data, checkpoints and the loop.

The engine of ``scripts/train_gpt.py``, importable so that tests call :func:`train` inside
``megatron_core.testing.run_distributed`` without torchrun. It sits on top of
``megatron_core.transformer``; nothing else in the package imports it.
"""

from megatron_core.training.arguments import (
    build_parser,
    data_parallel_size,
    parse_args,
    validate_args,
)
from megatron_core.training.checkpoint import (
    MANIFEST_FILENAME,
    TRACKER_FILENAME,
    LoadedCheckpoint,
    checkpoint_layout,
    load_checkpoint,
    save_checkpoint,
)
from megatron_core.training.data import (
    DEFAULT_CORPUS_DESCRIPTION,
    VOCAB_SIZE,
    ByteCorpus,
    get_batch,
)
from megatron_core.training.loop import (
    TrainingResult,
    build_model_and_optimizer,
    check_locally,
    initialize_distributed,
    learning_rate,
    model_config,
    padded_vocab_size,
    train,
    train_step,
)
from megatron_core.training.progress import Progress, format_bytes
from megatron_core.training.resume import schedule_changes

__all__ = [
    # arguments.py
    "build_parser",
    "parse_args",
    "validate_args",
    "data_parallel_size",
    # checkpoint.py
    "TRACKER_FILENAME",
    "MANIFEST_FILENAME",
    "LoadedCheckpoint",
    "checkpoint_layout",
    "save_checkpoint",
    "load_checkpoint",
    # data.py
    "DEFAULT_CORPUS_DESCRIPTION",
    "VOCAB_SIZE",
    "ByteCorpus",
    "get_batch",
    # loop.py
    "TrainingResult",
    "check_locally",
    "initialize_distributed",
    "padded_vocab_size",
    "model_config",
    "build_model_and_optimizer",
    "learning_rate",
    "train_step",
    "schedule_changes",
    "train",
    # progress.py
    "Progress",
    "format_bytes",
]
