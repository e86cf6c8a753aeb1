"""The recompute planner's predicted total against a whole training step's peak, read by torch's
CPU profiler switched on before the model is built (every block's size known, nothing subtracted).

One CPU process (gloo, world 1). Two models: megatron-core's GPTModel through the switch (local
spec: its attention hands ``baddbmm`` a ``[b * np, s, s]`` view of the global memory buffer,
made at the first forward and kept) and our GPT. Two runs per budget, each in a fresh process:

1. plan: build the model and AdamW, ``plan_recompute(model, forward, budget, optimizer)``; print
   the plan and its predicted peak (the allocator's total at the step's peak);
2. measure: switch the profiler on (``profile_memory``) as the process's first work, build the
   same model with that plan and AdamW, run two training steps (forward, backward, AdamW step);
   the largest bytes alive during the second step, replaying every allocation and free the
   session saw (blocks made before it, by torch's import, are not counted).

    python scripts/checks/check_recompute_plan_total.py --model megatron \
        --budgets 80MiB 100MiB 130MiB
    python scripts/checks/check_recompute_plan_total.py --model ours --budgets 40MiB 60MiB

Prints one row per budget: the plan, the prediction, the profiler's total, their difference,
and whether the total fits the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_MiB = 1 << 20
_HERE = os.path.dirname(os.path.abspath(__file__))
_SIZES = {"layers": 6, "hidden": 96, "heads": 6, "seq": 320, "batch": 3, "vocab": 256}


def _build(kind: str, fields: dict, choices: list | None):
    """The model (on its rank), AdamW and one microbatch's forward."""
    import torch

    from megatron_core import parallel_state, tensor_parallel

    s = _SIZES
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=gen)
    labels = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=gen)
    if kind == "megatron":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=True, **fields,
        )  # fmt: skip
        model = GPTModel(config, get_gpt_layer_local_spec(), s["vocab"], s["seq"])
        positions = torch.arange(s["seq"]).unsqueeze(0).expand(s["batch"], s["seq"])

        def forward():
            return model(tokens, positions, None, labels=labels).float().mean()

    else:
        from megatron_core.transformer import GPTModel, TransformerConfig

        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            hidden_dropout=0.1, attention_dropout=0.1,
        )  # fmt: skip
        model = GPTModel(config, s["vocab"], s["seq"])
        if choices is not None:
            model.decoder.set_layer_recompute(choices)

        def forward():
            return model(tokens, labels).mean()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, forward


def _start(kind: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
    if kind == "megatron":
        from megatron_core import megatron as switch

        switch.install()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def plan(kind: str, budget: str) -> dict:
    """Run 1: the plan and its prediction."""
    _start(kind)
    from megatron_core.tensor_parallel.recompute.planner import plan_recompute

    model, optimizer, forward = _build(kind, {}, None)
    chosen = plan_recompute(model, forward, budget, optimizer)
    fields = chosen.megatron["fields"] if chosen.megatron else None
    return {"choices": chosen.choices, "fields": fields, "predicted": chosen.predicted_peak,
            "static": chosen.stage.static, "states": chosen.stage.states,
            "budget": chosen.budget, "text": str(chosen)}  # fmt: skip


def measure(kind: str, fields: dict, choices: list) -> dict:
    """Run 2: the profiler from the first work of the process, two training steps."""
    import torch

    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    profiler.__enter__()
    _start(kind)
    model, optimizer, forward = _build(kind, fields, choices)
    for step in range(2):
        with torch.profiler.record_function(f"check:step{step}"):
            optimizer.zero_grad(set_to_none=True)
            forward().backward()
            optimizer.step()
    profiler.__exit__(None, None, None)
    from megatron_core import compat

    allocations, marks = compat.profiler_allocations(profiler, "check:")
    (begin, _), = [m for m in marks if m[1] == "check:step1"]  # fmt: skip
    blocks, live, peak = {}, 0, 0
    for at, nbytes, kind_, address in allocations:
        if kind_ != "cpu":
            continue
        if nbytes > 0:
            blocks[address] = nbytes
        elif address in blocks:
            nbytes = -blocks.pop(address)
        else:
            continue  # made before the session (torch's import)
        live += nbytes
        if at >= begin:
            peak = max(peak, live)
    return {"measured": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("megatron", "ours"), default="megatron")
    parser.add_argument("--budgets", nargs="+", default=["80MiB", "100MiB", "130MiB"])
    parser.add_argument("--run", help=argparse.SUPPRESS)  # a child: plan:BUDGET or measure:JSON
    args = parser.parse_args()
    if args.run:
        what, _, rest = args.run.partition(":")
        if what == "plan":
            print(json.dumps(plan(args.model, rest)))
        else:
            given = json.loads(rest)
            print(json.dumps(measure(args.model, given["fields"] or {}, given["choices"])))
        return
    print("| budget | plan | predicted (MiB) | of it, allocated before the step beyond the model "
          "states (MiB) | measured, profiler (MiB) | predicted - measured | fits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        planned = _child(args.model, f"plan:{budget}")
        given = {"fields": planned["fields"], "choices": planned["choices"]}
        measured = _child(args.model, "measure:" + json.dumps(given))["measured"]
        predicted = planned["predicted"]
        shown = planned["fields"] if args.model == "megatron" else planned["choices"]
        other = (planned["static"] - planned["states"]) / _MiB
        print(f"| {budget} | {shown} | {predicted / _MiB:.2f} | {other:.2f} | "
              f"{measured / _MiB:.2f} | "
              f"{(predicted - measured) / measured:+.1%} | "
              f"{'yes' if measured <= planned['budget'] else 'NO'} |", flush=True)


def _child(kind: str, run: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--model", kind, "--run", run], capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(_HERE, "..", ".."))
    main()
