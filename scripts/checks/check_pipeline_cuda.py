"""Check the pipeline schedules on CUDA + NCCL (or CPU + gloo) against the unpipelined GPT.

1. Every world size: ``forward_backward_no_pipelining`` with ``deallocate_pipeline_outputs`` on
   (so ``custom_backward`` runs) gives bitwise the gradients of a plain microbatch loop, on this
   device, for a small GPT (fp32 and bf16 parameters).
2. World size N > 1: ``train()`` at pp = N (1F1B) and at pp = N with interleaving (vp = 2) gives
   the losses of ``train()`` at pp = 1 (x dp = N) to 1e-5 relative over 10 steps, dropout off.
   TF32 is off so fp32 matmuls stay fp32.

Rank 0 prints one line per check and "OK" at the end; a mismatch exits with status 1.

Run (one rank per GPU; NCCL refuses two ranks on one device, so pp > 1 needs pp GPUs):
    torchrun --standalone --nproc_per_node=1 scripts/checks/check_pipeline_cuda.py      # check 1
    torchrun --standalone --nproc_per_node=2 scripts/checks/check_pipeline_cuda.py      # 1 and 2
The same on CPU + gloo:
    torchrun --standalone --nproc_per_node=2 scripts/checks/check_pipeline_cuda.py --device cpu
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_core import device, parallel_state  # noqa: E402
from megatron_core.pipeline_parallel import forward_backward_no_pipelining  # noqa: E402
from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_core.training import parse_args, train  # noqa: E402
from megatron_core.training.loop import initialize_distributed  # noqa: E402
from megatron_core.transformer import GPTModel, TransformerConfig  # noqa: E402

VOCAB, SEQ, BATCH, M = 256, 32, 2, 4


def _say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def _gpt(dtype: torch.dtype, deallocate: bool) -> GPTModel:
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype,
        deallocate_pipeline_outputs=deallocate,
    )  # fmt: skip
    return GPTModel(config, VOCAB, SEQ).to(device.current_device())


def _check_no_pipelining(dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, VOCAB, (M, BATCH, SEQ + 1), generator=g).to(device.current_device())
    plain, piped = _gpt(dtype, False), _gpt(dtype, True)
    for i in range(M):
        (plain(text[i, :, :-1], text[i, :, 1:]).mean() / M).backward()

    def forward_step(data_iterator, model):
        i = next(data_iterator)
        out = model(text[i, :, :-1], text[i, :, 1:])
        return out, lambda per_token: (per_token.mean(), {"loss": per_token.mean().detach()})

    forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(range(M)), model=piped,
        num_microbatches=M, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), piped.parameters()))
    _say(f"no pipelining + deallocate/custom_backward, {dtype}: grads bitwise equal: {same}")
    return same


def _losses(options: list[str], device_type: str) -> dict[int, float]:
    argv = [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10",
        "--log-interval", "1000", "--tensor-model-parallel-size", "1", "--device", device_type,
    ]  # fmt: skip
    return train(parse_args(argv + options)).losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    opts = parser.parse_args()
    initialize_distributed(opts.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = dist.get_world_size()
    _say(f"check_pipeline_cuda: {world} rank(s) on {device.device_type()} ({dist.get_backend()})")
    ok = True
    parallel_state.initialize_model_parallel()
    for dtype in (torch.float32, torch.bfloat16):
        ok &= _check_no_pipelining(dtype)
    parallel_state.destroy_model_parallel()
    if world > 1:
        reference = _losses([], opts.device)
        for name, extra in (
            (f"1F1B pp={world}", ["--pipeline-model-parallel-size", str(world)]),
            (
                f"interleaved pp={world} vp=2",
                [
                    "--pipeline-model-parallel-size",
                    str(world),
                    "--num-layers-per-virtual-pipeline-stage",
                    str(4 // (2 * world)),
                ],
            ),  # fmt: skip
        ):
            if 4 % (2 * world):
                _say(f"{name}: skipped (4 layers do not split into {2 * world} chunks)")
                continue
            losses = _losses(extra, opts.device)
            worst = max(abs(losses[k] - reference[k]) / abs(reference[k]) for k in reference)
            _say(f"{name}: losses vs pp=1 over 10 steps, max relative difference {worst:.2e}")
            ok &= worst <= 1e-5
    _say("OK" if ok else "FAILED")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
