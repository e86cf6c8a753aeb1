"""megatron-core's own GPTModel: through the switch (this package's modules, default consistency
mode and checks off) against megatron-core's own modules, CPU time and wall time per round.

Each launch starts ``--tp`` gloo ranks (fresh interpreters, one thread each) and trains
megatron-core's GPTModel (local spec, megatron-core's DistributedDataParallel, its
``get_forward_backward_func`` and ``finalize_model_grads``, plain SGD on ``main_grad``) for
``--rounds`` rounds of ``--steps`` iterations, as a user's benchmark would. ``--loop schedule``
(the default) runs each step through ``get_forward_backward_func`` with ``finalize_model_grads``
and an SGD update (every step marks an iteration); ``--loop forward-backward`` runs only each
microbatch's forward and ``loss.backward()``, as a micro-benchmark of a model would: nothing
marks an iteration there but the backward passes themselves (NOTE [ Check window ]).

* "ours": ``megatron_core.megatron.install()`` first. Two modes, alternating round by round
  (the order swapped every round): the default consistency mode (its window starts with the
  process and covers the first iterations: NOTE [ Check window ]) and every check off
  (``set_mode("off", restart_windows=False)``, so switching back does not reopen the window).
* "own": megatron-core's own modules, with only the switch's CPU mode on (it answers their CUDA
  calls on a CPU; no module of this package is served).

A round's CPU time is the sum over ranks of ``time.process_time()``, its wall time the slowest
rank's. The report gives medians of per-round ratios (default / off paired within a launch;
ours / own between launches, ``--launches`` pairs in alternating order), the totals over all
rounds, the first included (where the window's checks are paid), and the ratios of each mode's
least round after the first (a shared machine only adds to a round's work).

    python scripts/benchmarks/benchmark_megatron_gpt.py --rounds 11 --steps 5
    python scripts/benchmarks/benchmark_megatron_gpt.py --rounds 41 --steps 1 --launches 4 \
        --loop forward-backward
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts._ranks import cpu_sum_wall_max, run_ranks  # noqa: E402


def _build(args):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    extra = {}
    if args.recompute == "full":
        extra = dict(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
            distribute_saved_activations=True,
        )
    elif args.recompute == "selective":
        extra = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        tensor_model_parallel_size=args.tp,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        **extra,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
    )
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    return model, config


def _dropout_swaps(step) -> list[tuple[float, float]]:
    """The CPU mode's swap of the device stream around each dropout (NOTE [ RNG streams ], rule
    6): how many one step makes (counted by wrapping random.device_rng, whose name the CPU mode
    looks up per call) and what one costs alone (CPU microseconds, 2000 empty swaps)."""
    import contextlib

    from megatron_core.tensor_parallel import random as tp_random

    original, count = tp_random.device_rng, [0]

    @contextlib.contextmanager
    def counting():
        count[0] += tp_random._device_stream_apart()  # a swap happens only then
        with original():
            yield

    tp_random.device_rng = counting
    try:
        step()
    finally:
        tp_random.device_rng = original
    start = time.process_time()
    for _ in range(2000):
        with original():
            pass
    return [(float(count[0]), (time.process_time() - start) / 2000 * 1e6)]


def _rank(rank: int, impl: str, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.tp), LOCAL_RANK=str(rank))
    from megatron_core import megatron as switch
    from megatron_core.megatron import cpu_mode

    if impl == "ours":
        switch.install()
    else:
        cpu_mode.enable()
    dist.init_process_group("gloo", rank=rank, world_size=args.tp)
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, config = _build(args)
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    gen = torch.Generator().manual_seed(7)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        positions = torch.arange(args.seq).unsqueeze(0).expand(tokens.shape[0], -1)
        output = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])

        def loss_func(loss):
            mean = loss.float().mean()
            return mean, {"loss": mean.detach()}

        return output, loss_func

    def marked_step(data) -> None:
        model.zero_grad_buffer()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(data),
            model=[model],
            num_microbatches=args.microbatches,
            seq_length=args.seq,
            micro_batch_size=args.micro_batch,
        )
        with torch.no_grad():
            for param in model.parameters():
                param.add_(param.main_grad, alpha=-1e-3)

    def unmarked_step(data) -> None:
        model.zero_grad_buffer()
        for tokens in data:
            output, loss_func = forward_step(iter([tokens]), model)
            loss_func(output)[0].backward()

    def step() -> None:
        data = [
            torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
            for _ in range(args.microbatches)
        ]
        (marked_step if args.loop == "schedule" else unmarked_step)(data)

    modes = ["default", "off"] if impl == "ours" else ["own"]
    times = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            if impl == "ours":
                from megatron_core import consistency

                consistency.set_mode(None if mode == "default" else "off", restart_windows=False)
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                step()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            times[mode].append(cpu_sum_wall_max(cpu, wall))
    times["swap"] = _dropout_swaps(step)
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--launches", type=int, default=1, help="ours/own launch pairs")
    parser.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    parser.add_argument("--loop", choices=["schedule", "forward-backward"], default="schedule")
    args = parser.parse_args()
    tempfile.tempdir = tempfile.mkdtemp()
    rounds = {"default": [], "off": [], "own": []}
    swaps = {}  # launch kind -> (dropout swaps per step, CPU us per swap) on rank 0
    paired, later, against_own = [], [], []  # per-round CPU ratios
    rest = {"default": 0.0, "off": 0.0, "own": 0.0}  # CPU s after each launch's first round
    rest_rounds = {"default": [], "off": [], "own": []}  # (CPU, wall) after each first round
    for pair in range(args.launches):  # the order swapped every pair
        if pair % 2:
            own = run_ranks(_rank, args.tp, "own", args)
        ours = run_ranks(_rank, args.tp, "ours", args)
        if pair % 2 == 0:
            own = run_ranks(_rank, args.tp, "own", args)
        swaps["ours"], swaps["own"] = ours.pop("swap")[0], own.pop("swap")[0]
        paired += [d[0] / o[0] for d, o in zip(ours["default"], ours["off"])]
        later += paired[len(paired) - args.rounds + 1 :]
        against_own += [d[0] / o[0] for d, o in zip(ours["default"][1:], own["own"][1:])]
        for mode, values in [*ours.items(), *own.items()]:
            rounds[mode] += values
            rest[mode] += sum(c for c, _ in values[1:])
            rest_rounds[mode] += values[1:]
    print(
        f"megatron-core GPTModel, TP={args.tp}, {args.layers} layers, hidden {args.hidden}, "
        f"seq {args.seq}, {args.microbatches} x {args.micro_batch} sequences per step, "
        f"recompute {args.recompute}; {args.launches} launch pair(s) x {args.rounds} rounds x "
        f"{args.steps} steps"
    )
    print("| mode | median CPU s/round | median wall s/round | total CPU s | total wall s |")
    print("|---|---:|---:|---:|---:|")
    for mode, values in rounds.items():
        cpu = [c for c, _ in values]
        wall = [w for _, w in values]
        print(
            f"| {mode} | {statistics.median(cpu):.3f} | {statistics.median(wall):.3f} | "
            f"{sum(cpu):.2f} | {sum(wall):.2f} |"
        )
    med = {m: statistics.median(c for c, _ in v) for m, v in rounds.items()}
    total = {m: sum(c for c, _ in v) for m, v in rounds.items()}
    print(f"default / off, median of paired per-round CPU ratios: {statistics.median(paired):.4f}")
    print(f"default / off, total CPU (first round included): {total['default'] / total['off']:.4f}")
    print(
        f"ours default / own modules, median CPU: {med['default'] / med['own']:.4f}; "
        f"total CPU: {total['default'] / total['own']:.4f}"
    )
    print(f"ours off / own modules, median CPU: {med['off'] / med['own']:.4f}")
    for kind, (count, cost) in swaps.items():
        per_rank_step = statistics.median(c for c, _ in rounds[kind if kind == "own" else "off"])
        per_rank_step /= args.steps * args.tp  # CPU s of one rank's step
        print(
            f"{kind}: the CPU mode's dropout swap of the device stream: {count:.0f} per step "
            f"(rank 0), {cost:.2f} us each alone: {count * cost / 1e6 / per_rank_step:.4%} of a "
            "rank's step"
        )
    # a shared machine only ever adds to a round's work: the least round of each mode after
    # each launch's first is the one closest to the step's own cost (over --launches launches
    # for ours / own, which cannot share a process)
    least = {m: min(c for c, _ in v) for m, v in rest_rounds.items() if v}
    print(
        f"least round after the first: default / off {least['default'] / least['off']:.4f}; "
        f"ours default / own {least['default'] / least['own']:.4f}; ours off / own "
        f"{least['off'] / least['own']:.4f}"
    )
    if later:  # the first round of each launch left out: the window's steps are there
        print(
            f"after the first round: default / off {statistics.median(later):.4f} (median of "
            f"paired rounds), {rest['default'] / rest['off']:.4f} (total CPU); default / own "
            f"{statistics.median(against_own):.4f} (median of rounds paired by index), "
            f"{rest['default'] / rest['own']:.4f} (total CPU)"
        )


if __name__ == "__main__":
    main()
