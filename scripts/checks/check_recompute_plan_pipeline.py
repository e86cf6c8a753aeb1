"""The recompute planner's prediction on pipeline stages against a real step of the schedule.

Two gloo CPU ranks, our GPT split over two pipeline stages (the main job's pipeline build:
1F1B, or the interleaved schedule with ``--vp`` chunks per stage), ``--microbatches`` per step.
Each stage probes its own layers (its ``forward`` as NOTE [ Recompute planner ], rule 3 says;
every chunk of it under interleaving), then for every option on all of its layers the predicted
peak (the stage holding min(pp - stage, m) microbatches under 1F1B, its warm-up forwards plus
one chunk-microbatches interleaved, each keeping what its own chunk keeps, along the order
the schedule runs them; the later microbatches with every gradient allocated) is
printed beside the peak of one whole step of the schedule with that option, after one
unmeasured step with it (MemoryTimeline: the profiler's allocator events), both above the model
states.

    python scripts/checks/check_recompute_plan_pipeline.py
    python scripts/checks/check_recompute_plan_pipeline.py --microbatches 8 --layers 8 --seq 128
    python scripts/checks/check_recompute_plan_pipeline.py --vp 2 --layers 8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts._ranks import run_ranks  # noqa: E402

_KiB = 1 << 10
_VOCAB, _BATCH = 128, 2


def _rank(rank: int, args, port: int, queue) -> None:
    from megatron_core import parallel_state
    from megatron_core.pipeline_parallel import (
        get_forward_backward_func,
        interleaved_chunk_order,
    )
    from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron_core.tensor_parallel.recompute.planner import (
        in_flight_microbatches,
        measure_chunks,
        predict_peak,
        schedule_in_flight,
    )
    from megatron_core.tensor_parallel.recompute.planner.probe import step_peak
    from megatron_core.training.memory_plan import stage_probe_forward
    from megatron_core.training.pipeline_step import build_pipeline_model
    from megatron_core.transformer import TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    vp = args.vp
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vp
    )
    model_parallel_cuda_manual_seed(5)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32, hidden_dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    built = build_pipeline_model(config, _VOCAB, args.seq)
    chunks = list(built) if vp else [built]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, _VOCAB, (_BATCH, args.seq), generator=gen)
    labels = torch.randint(0, _VOCAB, (_BATCH, args.seq), generator=gen)
    # one microbatch of each of this stage's chunks
    forwards = [stage_probe_forward(chunk, tokens, labels, args.seq) for chunk in chunks]

    def forward_step(iterator, model):
        next(iterator)
        out = model(tokens if model.pre_process else None, labels if model.post_process else None)
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    m = args.microbatches
    stage = measure_chunks(chunks, forwards, repeats=1, microbatches=m)
    in_flight, order = in_flight_microbatches(m), ()
    if vp:  # the order the schedule runs this rank's chunks in (as the main job plans)
        order = tuple(interleaved_chunk_order(m, 2, rank, vp))
        in_flight = schedule_in_flight(order)
    stage = dataclasses.replace(stage, microbatches=m, in_flight=in_flight, order=order)
    rows = []
    for option in stage.options:
        choices = [option] * stage.layers
        for chunk in chunks:
            chunk.decoder.set_layer_recompute(choices)

        def step():
            get_forward_backward_func()(
                forward_step_func=forward_step, model=chunks if vp else chunks[0],
                data_iterator=[iter(range(m)) for _ in chunks] if vp else iter(range(m)),
                num_microbatches=m, seq_length=args.seq, micro_batch_size=_BATCH,
            )  # fmt: skip

        step()  # unmeasured: an option's first step under the timeline keeps a little more
        measured = step_peak(chunks, step)
        rows.append((rank, stage.in_flight, option, predict_peak(stage, choices), measured))
    gathered = [None, None] if rank == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if rank == 0:
        queue.put([row for part in gathered for row in part])
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--vp", type=int, default=None, help="chunks per stage (interleaved)")
    args = parser.parse_args(argv)
    rows = run_ranks(_rank, 2, args)
    schedule = "1F1B" if args.vp is None else f"interleaved ({args.vp} chunks each)"
    print(f"two {schedule} stages, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"batch {_BATCH}, {args.microbatches} microbatches (CPU, gloo, fp32)")  # fmt: skip
    print("| stage | held at once | option (every layer) | predicted KiB | measured KiB | error |")
    print("|---|---|---|---|---|---|")
    for rank, held, option, predicted, measured in rows:
        error = (predicted - measured) / measured
        print(f"| {rank} | {held} | {option} | {predicted / _KiB:,.1f} | {measured / _KiB:,.1f} "
              f"| {error:+.1%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
