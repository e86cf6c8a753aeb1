"""Check parallel_state on CUDA + NCCL with the NCCL-only options, group by group.

Initializes with NCCL communicator settings (a generated yaml config, high-priority streams, the
separate all-gather group; SHARP on request), checks that every group this rank got has the ranks
compute_rank_layout predicts, and runs an all_reduce of the global ranks on each group. Rank 0
prints one line per group kind and "OK" at the end; any mismatch exits with status 1.

Run (one GPU; one rank per GPU, NCCL refuses two ranks on one device):
    torchrun --standalone --nproc_per_node=1 scripts/checks/check_parallel_state_nccl.py
    torchrun --standalone --nproc_per_node=8 scripts/checks/check_parallel_state_nccl.py \
        --tp 2 --cp 2 --ep 2
The same checks without NCCL, for a CPU machine:
    torchrun --standalone --nproc_per_node=4 scripts/checks/check_parallel_state_nccl.py \
        --device cpu --tp 2
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core import parallel_state as ps


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-model-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size")
    parser.add_argument("--dist-opt-instances", type=int, default=1)
    parser.add_argument("--order", default="tp-cp-ep-dp-pp")
    parser.add_argument("--use-sharp", action="store_true", help="needs a SHARP-capable fabric")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return parser.parse_args()


def _write_config() -> str | None:
    """A communicator config that sets every key (each rank writes and reads its own copy)."""
    try:
        import yaml  # noqa: F401
    except ImportError:
        print("PyYAML missing: running without nccl_communicator_config_path", flush=True)
        return None
    path = os.path.join(tempfile.mkdtemp(), "nccl_comm.yaml")
    with open(path, "w") as f:
        f.write("dp_cp:\n  max_ctas: 16\n  min_ctas: 1\ntp:\n  cga_cluster_size: 2\n")
        f.write("ep:\n  net_name: socket\n")
    return path


def main() -> int:
    args = _parse()
    device.set_device_type(args.device)
    device.set_current_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(device.default_backend())
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        num_distributed_optimizer_instances=args.dist_opt_instances,
        order=args.order,
        nccl_communicator_config_path=_write_config(),
        high_priority_stream_groups=["dp_cp", "tp"],
        create_all_gather_group=True,
        use_sharp=args.use_sharp,
    )
    layout = ps.compute_rank_layout(
        world, args.tp, args.pp, args.cp, args.ep, args.order,
        expert_tensor_parallel_size=args.etp,
        num_distributed_optimizer_instances=args.dist_opt_instances,
    )  # fmt: skip
    state = ps.get_parallel_state()
    failures = []
    lines = [f"backend {dist.get_backend()}, world {world}"]
    for kind in sorted(state.groups):
        group = state.groups[kind]
        expected = [g for g in layout.get(kind.removesuffix("-ag"), []) if rank in g]
        got = dist.get_process_group_ranks(group)
        if not expected or sorted(expected[0]) != got:
            failures.append(f"rank {rank} {kind}: got {got}, expected {expected}")
        x = torch.tensor([float(rank)], device=device.current_device())
        dist.all_reduce(x, group=group)
        if int(x.item()) != sum(got):
            failures.append(f"rank {rank} {kind}: all_reduce gave {x.item()}, not {sum(got)}")
        lines.append(f"{kind:20s} ranks {got} all_reduce sum {int(x.item())}")
    device.synchronize()
    failed = torch.tensor([len(failures)], device=device.current_device())
    dist.all_reduce(failed)
    for line in failures:
        print(line, flush=True)
    if rank == 0:
        print("\n".join(lines))
        print("OK" if failed.item() == 0 else f"FAILED: {int(failed.item())} problem(s)")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
