"""Train a small byte-level GPT with tensor parallelism: the main job.

Run on a CPU machine (2 ranks, gloo; the TP size defaults to the largest that fits):
    python scripts/train_gpt.py --nproc-per-node 2
or with torchrun:
    torchrun --standalone --nproc_per_node=2 scripts/train_gpt.py

Options (see --help): --tensor-model-parallel-size, --sequence-parallel, --recompute-*,
--data PATH (your own text file), --save/--load DIR (resharding: load at any TP/DP size),
--device cuda (nccl, one GPU per rank), --debug (Python tracebacks). Failures print one line
(NOTE [ Clean exits ] in megatron_core/training/launcher.py). The training loop lives in
megatron_core.training.
"""

import os
import sys

from megatron_core import device
from megatron_core.training import check_locally, initialize_distributed, parse_args, train
from megatron_core.training.launcher import launch


def _nproc_per_node(argv) -> int:
    return parse_args(argv).nproc_per_node


def main() -> int:
    """One rank: parse arguments, start the process group and train; returns the exit status."""
    args = parse_args(sys.argv[1:])
    # A bad layout, model or data file fails on every rank before any connection is made: a rank
    # that exited after the process group started could break a peer's gloo connection set-up,
    # and the peer would report that instead (NOTE [ Clean exits ], rule 1).
    corpus = check_locally(args, int(os.environ.get("WORLD_SIZE", "1")))
    initialize_distributed(args.device, args.distributed_timeout_minutes)
    if device.device_type() == "cpu":  # a step's large tensors reuse memory, not fault it in
        device.keep_freed_host_memory()
    train(args, corpus=corpus)
    return 0


if __name__ == "__main__":
    launch("train_gpt.py", __file__, sys.argv[1:], _nproc_per_node, main)
