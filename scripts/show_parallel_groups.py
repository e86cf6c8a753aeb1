"""Print every rank's process groups as a table.

Run (4 CPU ranks, tp=2, pp=2):
    torchrun --standalone --nproc_per_node=4 scripts/show_parallel_groups.py --tp 2 --pp 2
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.tensor_parallel import gather_split_1d_tensor

# (column title, group kind in ParallelState.ranks)
COLUMNS = [
    ("tp", "tp"),
    ("pp", "pp"),
    ("dp", "dp"),
    ("cp", "cp"),
    ("model (tp x pp)", "mp"),
    ("embedding", "embedding"),
    ("ep", "ep"),
    ("expert tp", "expt-tp"),
    ("expert dp", "expt-dp"),
]


def _gather_rows(row: list[str]) -> list[list[str]]:
    """All-gather every rank's row of strings (as UTF-8 bytes in a fixed-size uint8 tensor)."""
    data = "\t".join(row).encode()
    width = 1024
    if len(data) > width:
        raise SystemExit(f"row of rank {dist.get_rank()} is {len(data)} bytes (> {width})")
    mine = torch.zeros(width + 8, dtype=torch.uint8)
    mine[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    mine[8 : 8 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    everyone = gather_split_1d_tensor(mine.to(device.current_device()), group=dist.group.WORLD)
    rows = []
    for chunk in everyone.cpu().view(dist.get_world_size(), -1):
        size = int.from_bytes(bytes(chunk[:8].tolist()), "little")
        rows.append(bytes(chunk[8 : 8 + size].tolist()).decode().split("\t"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-model-parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-model-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-model-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (tp)")
    parser.add_argument("--order", default="tp-cp-ep-dp-pp", help="rank grid order")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()

    device.set_device_type(args.device)
    device.set_current_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(device.default_backend())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        order=args.order,
    )
    state = parallel_state.get_parallel_state()
    # Middle pipeline stages are in no embedding group: "-".
    row = [str(dist.get_rank())] + [str(state.ranks.get(kind, "-")) for _, kind in COLUMNS]
    rows = _gather_rows(row)
    if dist.get_rank() == 0:
        header = ["rank"] + [name for name, _ in COLUMNS]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
        print("-+-".join("-" * w for w in widths))
        for r in rows:
            print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    parallel_state.destroy_model_parallel()
    # Exit cleanly: no rank tears gloo down while a peer still has the last
    # gather in flight (the barrier), the group is destroyed explicitly, and the interpreter's
    # finalizers never run over gloo's threads (os._exit; NOTE [ Clean exits ] in
    # megatron_core/training/launcher.py, rule 4).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
