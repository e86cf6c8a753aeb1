"""Check the tensor-parallel layers on CUDA + NCCL against a serial torch reference.

Every rank builds the same full weights (``use_cpu_initialization=True``, fixed seed) and input,
runs ColumnParallelLinear -> GELU -> RowParallelLinear and VocabParallelEmbedding at TP = world
size (with and without sequence parallelism, fp32 and bf16 parameters, a frozen first weight),
and compares outputs and gradients with ``torch.nn.functional`` on the full tensors. It also
checks that weights drawn on the GPU (``use_cpu_initialization=False``) come from the
"model-parallel-rng" stream, and that bf16 sums run natively on NCCL (upcast only on gloo).
Rank 0 prints one line per check and "OK" at the end; any mismatch exits with status 1.

Run (one rank per GPU; NCCL refuses two ranks on one device):
    torchrun --standalone --nproc_per_node=1 scripts/checks/check_tensor_parallel_cuda.py
    torchrun --standalone --nproc_per_node=8 scripts/checks/check_tensor_parallel_cuda.py
The same checks on CPU + gloo:
    torchrun --standalone --nproc_per_node=4 scripts/checks/check_tensor_parallel_cuda.py \
        --device cpu
"""

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import ModelParallelConfig, device
from megatron_core import parallel_state as ps
from megatron_core import tensor_parallel as tp
from megatron_core.tensor_parallel import _collectives

SEQ, BATCH, HIDDEN, FFN, VOCAB = 16, 2, 64, 256, 512  # divisible by 8
# fp32: shard-then-reduce changes only the summation order (fp32 rounding); TF32 is off below.
# bf16 parameters: inputs and weights are bf16 roundings in both computations; the products are
# accumulated in fp32 by both, but bf16 outputs round at 2**-8 relative.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _init(t):
    return torch.nn.init.normal_(t, std=0.05)


def _full(out_size, in_size, seed, dtype):
    torch.manual_seed(seed)
    return _init(torch.empty(out_size, in_size)).to(dtype)


def _mlp(world, rank, dtype, sp, frozen, dev):
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp and world > 1,
                              use_cpu_initialization=True, params_dtype=dtype)  # fmt: skip
    torch.manual_seed(1)
    col = tp.ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=_init).to(dev)
    torch.manual_seed(2)
    row = tp.RowParallelLinear(FFN, HIDDEN, config=cfg, init_method=_init, bias=True,
                               input_is_parallel=True, skip_bias_add=False).to(dev)  # fmt: skip
    col.weight.requires_grad_(not frozen)
    w1, w2 = _full(FFN, HIDDEN, 1, dtype).to(dev), _full(HIDDEN, FFN, 2, dtype).to(dev)
    w1.requires_grad_(not frozen)
    w2.requires_grad_()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype).to(dev)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype).to(dev)
    x_ref = x.clone().requires_grad_()
    y_ref = F.linear(F.gelu(F.linear(x_ref, w1)), w2)
    y_ref.backward(dy)
    cut = (lambda t: t.chunk(world, dim=0)[rank]) if cfg.sequence_parallel else (lambda t: t)
    x_in = cut(x).clone().requires_grad_()
    hidden, _ = col(x_in)
    y, _ = row(F.gelu(hidden))
    y.backward(cut(dy))
    close = lambda a, b: torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])  # noqa: E731
    close(y, cut(y_ref))
    close(x_in.grad, cut(x_ref.grad))
    close(row.weight.grad, w2.grad.chunk(world, dim=1)[rank])
    if frozen:
        assert col.weight.grad is None
    else:
        close(col.weight.grad, w1.grad.chunk(world, dim=0)[rank])


def _embedding(world, rank, dev):
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
    torch.manual_seed(4)
    emb = tp.VocabParallelEmbedding(VOCAB, HIDDEN, init_method=_init, config=cfg).to(dev)
    table = _full(VOCAB, HIDDEN, 4, torch.float32).to(dev)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(emb(ids.to(dev)), F.embedding(ids.to(dev), table))


def _gpu_init(dev):
    tp.model_parallel_cuda_manual_seed(1234)
    cfg = ModelParallelConfig(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    col = tp.ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=_init)
    assert col.weight.device.type == dev.type, col.weight.device
    expected = torch.empty_like(col.weight)
    tp.model_parallel_cuda_manual_seed(1234)
    with tp.get_cuda_rng_tracker().fork():
        _init(expected)
    torch.testing.assert_close(col.weight, expected, rtol=0, atol=0)


def _native_half_sums(kind):
    """NOTE [ Half-precision sums ] in _collectives.py: only gloo upcasts."""
    half = torch.ones(4, dtype=torch.bfloat16, device=device.current_device())
    expected = torch.float32 if kind == "cpu" else torch.bfloat16
    got = _collectives._sum_dtype(half, ps.get_tensor_model_parallel_group())
    assert got == expected, f"bf16 sums run in {got} on {dist.get_backend()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    device.set_device_type(args.device)
    device.set_current_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(device.default_backend())
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    dev = device.current_device()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"world {world}, device {dev}, backend {dist.get_backend()}", flush=True)
    failed = False
    checks = []
    for dtype in (torch.float32, torch.bfloat16):
        for sp in (False, True):
            for frozen in (False, True):
                run = functools.partial(_mlp, world, rank, dtype, sp, frozen, dev)
                checks.append((f"mlp {dtype} sp={sp} frozen={frozen}", run))
    checks.append(("embedding", functools.partial(_embedding, world, rank, dev)))
    checks.append(("device init in the tracker stream", functools.partial(_gpu_init, dev)))
    checks.append(
        (
            "bf16 sum dtype (fp32 on gloo, native on nccl)",
            functools.partial(_native_half_sums, args.device),
        )
    )
    for name, check in checks:
        try:
            check()
            say(f"ok    {name}", flush=True)
        except Exception as exc:  # report every check, then fail
            failed = True
            print(f"FAIL  rank {rank} {name}: {type(exc).__name__}: {exc}", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    say("FAILED" if failed else "OK", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
