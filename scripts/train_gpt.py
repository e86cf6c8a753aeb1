"""Train a small byte-level GPT with tensor parallelism: the main job.

Run on a CPU machine (2 ranks, tp=2, gloo; about two minutes):
    torchrun --standalone --nproc_per_node=2 scripts/train_gpt.py

Options (see --help): --tensor-model-parallel-size, --sequence-parallel, --recompute-*,
--data PATH (your own text file), --save/--load DIR, --device cuda (nccl, one GPU per rank).
The training loop lives in megatron_core.training.
"""

import sys

import torch.distributed as dist

from megatron_core.errors import MegatronCoreError
from megatron_core.training import initialize_distributed, parse_args, train


def main() -> int:
    """Parse arguments, start the process group and train; returns the exit status."""
    try:
        args = parse_args()
        initialize_distributed(args.device)
    except MegatronCoreError as exc:  # bad arguments, or --device cuda without a GPU
        print(f"train_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    try:
        train(args)
    except MegatronCoreError as exc:  # raised on every rank alike; rank 0 reports it
        if dist.get_rank() == 0:
            print(f"train_gpt.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
