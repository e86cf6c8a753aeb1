"""Byte-level training data: a corpus read as bytes (vocabulary 256), sampled per iteration.

The default corpus needs no download: the megatron_core package's own Python source, plus the
repository's README.md when the package runs from a checkout. ``--data PATH`` trains on any file.

Batches are a pure function of (seed, iteration): the global batch of an iteration is the same
whatever the parallel layout and whether the run was resumed, so TP=1 and TP=2 runs see the
same tokens and a resumed run continues with the batch the uninterrupted run would have used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_core import device, parallel_state
from megatron_core.context_parallel import split_for_context_parallel
from megatron_core.errors import MegatronCoreError
from megatron_core.tensor_parallel.data import broadcast_data

__all__ = ["DEFAULT_CORPUS_DESCRIPTION", "VOCAB_SIZE", "ByteCorpus", "get_batch"]

VOCAB_SIZE = 256
DEFAULT_CORPUS_DESCRIPTION = (
    "the megatron_core package's own Python source and the repository README.md, read as bytes "
    "(no download)"
)
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def _default_files() -> list[Path]:
    files = sorted(_PACKAGE_DIR.rglob("*.py"))
    readme = _PACKAGE_DIR.parent / "README.md"
    return files + ([readme] if readme.is_file() else [])


class ByteCorpus:
    """A corpus held as one uint8 tensor; token id = byte value.

    Args:
        data: the corpus bytes.
        name: what it is, for the progress output.
    """

    def __init__(self, data: bytes, name: str):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.name = name

    @classmethod
    def load(cls, path: str | None, seq_length: int) -> ByteCorpus:
        """Read ``path`` (None: the default corpus) and check it holds a sample.

        Raises:
            MegatronCoreError: the file cannot be read or is shorter than seq_length + 1 bytes.
        """
        if path is None:
            files = _default_files()
            data = b"\n".join(f.read_bytes() for f in files)
            name = f"default corpus ({len(files)} files of megatron_core source and docs)"
        else:
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise MegatronCoreError(f"--data {path!r}: cannot read it ({exc})") from None
            name = str(path)
        if len(data) < seq_length + 1:
            raise MegatronCoreError(
                f"corpus {name!r} has {len(data)} bytes; a sample needs --seq-length "
                f"({seq_length}) + 1"
            )
        return cls(data, name)

    def __len__(self) -> int:
        return self.tokens.numel()

    def global_batch(self, iteration: int, batch_size: int, seq_length: int, seed: int):
        """The ``batch_size`` windows of seq_length + 1 tokens of ``iteration``: [b, s + 1] int64.

        Window starts are drawn uniformly by a private generator seeded from (seed, iteration),
        so no global RNG state is used or changed.
        """
        gen = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
        starts = torch.randint(0, len(self) - seq_length, (batch_size, 1), generator=gen)
        return self.tokens[starts + torch.arange(seq_length + 1)].long()


def get_batch(corpus: ByteCorpus, args, iteration: int, microbatch: int):
    """This rank's (tokens, labels), each [micro batch, seq_length], on the current device.

    The data-parallel rank d takes rows [d * B/dp, (d + 1) * B/dp) of the global batch B and
    microbatch m of that share. Tensor-parallel rank 0 builds it and ``broadcast_data`` sends it
    to the rest of its TP group, as megatron does. Under context parallelism each rank keeps
    its part of the sequence ([micro batch, seq_length / cp]: chunks r and 2 cp - 1 - r).
    """
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    data = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        share = args.global_batch_size // dp_size
        start = dp_rank * share + microbatch * args.micro_batch_size
        batch = corpus.global_batch(iteration, args.global_batch_size, args.seq_length, args.seed)
        data = {"text": batch[start : start + args.micro_batch_size].to(device.current_device())}
    text = broadcast_data(["text"], data, torch.int64)["text"]
    tokens, labels = text[:, :-1], text[:, 1:]
    # this context-parallel rank's part of the sequence (NOTE [ Context parallelism ])
    tokens, labels = (split_for_context_parallel(x, 1) for x in (tokens, labels))
    return tokens.contiguous(), labels.contiguous()
