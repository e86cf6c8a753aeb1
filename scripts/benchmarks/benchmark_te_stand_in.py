"""megatron-core's GPTModel with its Transformer Engine spec on the stand-in against the same model
with megatron-core's local spec, on CPU ranks through the switch: time per training step.

One launch starts ``--tp`` gloo ranks (spawned interpreters, one thread each), installs the switch
(which serves the stand-in) and builds both models with the same TransformerConfig: the local
spec (megatron-core's ColumnParallelLinear / RowParallelLinear, its own unfused core attention
with the fused-softmax module) and the Transformer Engine spec (the stand-in's LayerNormLinear,
Linear and DotProductAttention on the attention core). Rounds alternate between the two models
(the order swapped every round), each ``--steps`` steps of forward, backward and an SGD update
on fresh random tokens. A round's CPU time is the sum over ranks of ``time.process_time()``, its
wall time the slowest rank's. The report gives per-model medians and the median of per-round
ratios TE / local (rounds paired by index), for each ``--seq`` given.

    python scripts/benchmarks/benchmark_te_stand_in.py --seq 256 1024 --rounds 7 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts._ranks import cpu_sum_wall_max, run_ranks  # noqa: E402


def _build(args, seq: int, spec_name: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        tensor_model_parallel_size=args.tp,
        hidden_dropout=0.1,
        attention_dropout=args.attention_dropout,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    spec = (
        get_gpt_layer_with_transformer_engine_spec()
        if spec_name == "te"
        else (get_gpt_layer_local_spec())
    )
    return GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=seq)


def _step(model, optimizer, args, seq: int, gen: torch.Generator) -> None:
    """Forward, backward and an SGD update on fresh random tokens."""
    tokens = torch.randint(0, args.vocab, (args.batch, seq + 1), generator=gen)
    positions = torch.arange(seq).unsqueeze(0).expand(args.batch, -1)
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    optimizer.step()


def _rank(rank: int, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.tp), LOCAL_RANK=str(rank))
    from megatron_core import megatron as switch

    switch.install()
    dist.init_process_group("gloo", rank=rank, world_size=args.tp)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    gen = torch.Generator().manual_seed(7)
    results = {}
    for seq in args.seq:
        models = {name: _build(args, seq, name) for name in ("local", "te")}
        optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-4) for n, m in models.items()}
        for name in models:  # one untimed step each (lazy set-up, first-call costs)
            _step(models[name], optimizers[name], args, seq, gen)
        times = {name: [] for name in models}
        for r in range(args.rounds):
            for name in ("local", "te") if r % 2 == 0 else ("te", "local"):
                dist.barrier()
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(args.steps):
                    _step(models[name], optimizers[name], args, seq, gen)
                times[name].append(
                    cpu_sum_wall_max(time.process_time() - cpu, time.perf_counter() - wall)
                )
        results[seq] = times
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = run_ranks(_rank, args.tp, args)
    print(
        f"megatron-core GPTModel, TP={args.tp}, {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads, batch {args.batch}, attention dropout {args.attention_dropout}, "
        f"hidden dropout 0.1, fp32; {args.rounds} rounds x {args.steps} steps per model "
        f"(torch {torch.__version__})"
    )
    print("| seq | spec | median CPU s/step | median wall s/step | TE/local CPU | TE/local wall |")
    print("|---:|---|---:|---:|---:|---:|")
    for seq, times in results.items():
        cpu = {n: [c / args.steps for c, _ in v] for n, v in times.items()}
        wall = {n: [w / args.steps for _, w in v] for n, v in times.items()}
        ratio_cpu = statistics.median(t / loc for t, loc in zip(cpu["te"], cpu["local"]))
        ratio_wall = statistics.median(t / loc for t, loc in zip(wall["te"], wall["local"]))
        for name in ("local", "te"):
            ratios = (f"{ratio_cpu:.3f}", f"{ratio_wall:.3f}") if name == "te" else ("", "")
            print(
                f"| {seq} | {name} | {statistics.median(cpu[name]):.4f} | "
                f"{statistics.median(wall[name]):.4f} | {ratios[0]} | {ratios[1]} |"
            )


if __name__ == "__main__":
    main()
