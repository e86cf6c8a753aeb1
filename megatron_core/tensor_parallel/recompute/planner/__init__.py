"""The recompute planner: a memory budget in, the fastest recompute plan that fits out.

Example (our GPT; ``forward`` returns the scalar loss of one microbatch)::

    from megatron_core.tensor_parallel.recompute.planner import plan_recompute

    plan = plan_recompute(model, lambda: model(tokens, labels).mean(), "2GiB", optimizer)
    print(plan)          # per-layer choices, predicted peak and overhead, megatron-core fields
    plan.apply(model)    # TransformerBlock.set_layer_recompute(plan.choices)

# NOTE [ Recompute planner ]
1. Options. Each layer of the model's TransformerBlock gets one of :func:`candidate_options`:
   "none"; selective recompute of megatron-core's modules ("selective:core_attn",
   "+activation", "+layernorm", or "mlp" whole); "full" (the layer is one checkpoint, only its
   input kept: megatron-core's full recompute, block method, one layer); "full_distributed"
   (that input split over the TP group; TP > 1 without sequence parallelism).
2. Measure, do not guess. For every option, one probe step of the user's own model, data,
   layout and precision with that option on every layer runs under a :class:`MemoryTimeline`
   (probe.py: ``max_memory_allocated`` on CUDA, the profiler's allocator events on the
   CPU) with marks after each layer's forward, after the loss, and as each layer's backward
   begins and ends. From them, per option o: ``k_o`` the bytes one layer keeps for backward
   (the step between consecutive layers' forward marks), ``fwd_o`` / ``bwd_o`` the most a
   layer's forward / backward (recompute included) allocates above what was allocated as it
   began, and ``u_o`` what a layer's forward and backward together leave allocated (its
   parameters' gradients; under autocast also weight casts a recompute made). From the "none"
   probe: ``pre`` (kept before the first layer: embeddings, inputs), the head (final norm,
   logits, loss: its peak above the last layer's mark, and what it leaves for the backward)
   and the tail (embedding backward). Each option's step is timed in ``repeats`` rounds, run
   round-robin over the options in a rotated order, as the step's work on this rank
   (``device.StepTimer``: this thread's CPU time on the CPU, CUDA events on a GPU), which
   other processes on a shared machine do not move as they move the wall clock (beside two
   busy loops on 2 cores a wall-clock plan swapped to one 1.16x slower). CPU time moves with a
   shared machine too, but only upwards (a core's other hardware thread, the caches: on 2
   shared cores one option's median cost read 7 ms in one process and 20 ms in the next), so
   ``t_o`` is an option's least round; an option costs ``(t_o - t_none) / L`` per layer, at
   least its share of a layer's forward FLOPs times a third of a layer's step (``flop_ms``:
   the fallback where timing cannot see it), and at least what any option recomputing less of
   the layer costs. On a CPU with glibc's default malloc, a step's large frees can go back to
   the kernel and be faulted in again at the next step, by the process's history more than by
   the plan (one plan of a 6-layer GPT: 5.6k and 27.6k faults per step in two processes, 350
   and 397 ms); ``device.keep_freed_host_memory()``, which the main job calls, steadies it.
   How far an option's median round lies above its least is the stage's
   timing noise (``noise_ms``, rule 4), and rule 4 times the plans that could be the fastest
   side by side. ``static``, what is
   allocated as a step begins, is the allocator's total after the probes with the gradients
   dropped, nothing subtracted (``device.allocated_bytes``: ``memory_allocated`` on CUDA, a
   census of the live storages on the CPU), plus the optimizer states its first step will
   make where it has not stepped (``pending_optimizer_state_bytes``): the model and optimizer
   states, the data, and the buffers the model or its libraries made at the warm-up step and
   keep for good (megatron-core's global memory buffer, the ``[b * np, s, s]`` scores its
   local attention hands ``baddbmm``: 2 GiB in fp32 at s = 4096, 32 heads per rank, b = 1).
   They are counted where the probe finds them allocated, from no list of known buffers; a
   probe step that leaves more than 1% of its peak allocated (a buffer its option needs and
   the warm-up's did not) runs once more with the buffer there. The model states counted from
   the objects (``model_state_bytes``) are shown beside it. A budget bounds that total at the
   step's peak, what ``max_memory_allocated`` reads after a reset on a GPU.
3. Prediction. With K_j the kept bytes of layers 0..j and U_j what layers j+1.. left after
   their backward, the step's peak above ``static`` is the largest of
   ``pre + K_{j-1} + fwd_{o_j}`` (layer j's forward), ``pre + K_{L-1} + head``, ``pre +
   head_left + K_j + U_j + bwd_{o_j}`` (layer j's backward: layers after j have freed what
   they kept) and the tail after layer 0's backward. Layers of one block are alike: an
   option's kept and left bytes are the means over the probed layers, its forward and backward
   peaks the largest. With m > 1 microbatches a step has two kinds of them: the first, as
   above, and the later ones, which run with every gradient G already allocated (the
   ``.grad`` tensors the first backward made, counted from the parameters) and leave nothing
   new behind their layers' backward (u counts 0): G plus that microbatch's peak, its layers'
   backward peaks measured (with m > 1 every probe step runs a second microbatch, the
   gradients accumulating: ``OptionMeasure.backward_later``, which allocates no gradient; the
   first's peak overstated a later one's by up to 6.8% on the last 1F1B stage). Under 1F1B
   pipeline parallelism stage i of p holds w = min(p - i, m) microbatches at once
   (:func:`in_flight_microbatches`): each of the w - 1 others keeps ``pre + K_{L-1}``, added to
   both kinds. Under the interleaved schedule a rank runs vp model chunks of L layers each;
   every chunk is probed, and one plan serves all of them (:func:`measure_chunks`: each
   chunk's own numbers, and for the time model the times summed). The caller passes the
   order the schedule runs the rank's chunks in, ``schedule`` (from
   ``pipeline_parallel.interleaved_chunk_order``: this family does not import the
   schedules), and the prediction walks it: at every forward and backward, what the held
   chunk-microbatches keep (each its own chunk's ``pre + K + head_left``: the first chunk
   keeps the embedding's, a later one its received input), plus the gradients of the chunks
   whose first backward has run, plus that chunk's forward or backward peak (first or later
   kind). At most its warm-up forwards plus one are held. Taking every held one to keep what
   the largest chunk keeps (what ``in_flight`` alone gives) read up to 6.4% above the step on
   stage 0 with full recompute, where ``pre`` is most of what a layer keeps; the order's walk
   -2.7% to +4.7% (the measured step itself varying by 4.5% between runs). The search prunes
   with the smallest chunk's numbers and rule 4's in-flight count (at most what the walk reads
   at the first backward and at the steady phase's second forward and backward, where the
   others held number the warm-up forwards) and checks each finished plan with the walk. A
   stage is probed alone: its ``forward`` makes the stage's input itself (a stage after the
   first) and returns the output times a gradient-shaped tensor, summed (a stage before the
   last), so one probe measures what one microbatch keeps there; the schedule's own buffers
   (received gradients, sends in flight) are not probed: the schedule holds nothing of a
   microbatch past its backward (NOTE [ Pipeline outputs ], rule 5), and what its buffers add
   stays within 1% of a stage's peak on the CPU; the headroom keeps 5% more where a step has
   several microbatches (rule 5). Where it can be wrong: a forward whose allocations depend on
   the data, allocator caching and fragmentation on CUDA (``max_memory_allocated`` counts live
   tensors, not reserved memory), autocast's weight-cast cache (held to the end of the
   forward, whatever recomputes), timing noise.
4. Search. Dynamic programming over the layers with K (the kept bytes so far) as the state: a
   state with more kept bytes and no less time is dropped (it can only meet later bounds less
   easily), and the cost is a sum over layers. The backward terms also depend on the layers
   after j through U_j, bounded in the search by (L - 1 - j) times the largest u (u differs
   little between options: gradients are the same); the chosen plan's own prediction is
   exact, and at most the bound. Without that bound the search would be exact. The states
   per layer are at most the distinct sums of L options' k (a few thousand for the layer
   counts and option sets here). Rule 3's other microbatches and gradients grow with the
   final K: a state is dropped when even its kept-so-far breaks the limit with them (the
   final K is at least that), and each finished plan is checked against its exact prediction.
   No plan fits: the error names the smallest budget that fits (a bisection over the budget) and
   what that plan recomputes. Last, the plans that fit and could be the fastest are timed side by
   side (contest.py): the search's plan, the fastest megatron-core setting that fits (rule 6),
   its rivals (``RecomputePlan.rivals``: every other megatron-core setting that fits, save one
   that recomputes all that another fitting setting does and more -- whatever the time model
   rates it, since a time model measured beside other work can rate a setting far above its true
   cost: beside two busy loops it put full recompute of 3 of 6 layers above 1.5x selective
   core_attn, which it beat by 1.28x side by side -- the search's plan under the FLOP-share
   costs alone, and, for each selective option the plan uses, the search's plan with that option
   costing twice its uniform probe's time, since among layers that keep theirs it can cost 2-4x
   that) and the near-budget edges below. Where they differ, each runs at least 5
   rounds of one step, round-robin in a rotated order (the slowest rank's times), and a
   candidate's time is the median over the rounds of its step over the geometric mean of all the
   candidates' steps in that round, times the median of those means (``contest.paired_times``):
   plans that ran back to back compare far more steadily than their steps do (on 2 shared cores
   one step of megatron-core's GPTModel read 400 to 601 ms within one quiet process, and the
   least rounds there ranked selective core_attn 6% faster than full recompute of 3 layers, which
   is faster side by side; beside the test suite one run of five chose it). Those within 15% of
   the fastest run as many rounds again and are timed from all the rounds that ran them together,
   and the fastest is the plan (``RecomputePlan.timed``), unless it recomputes all that another
   candidate does and more (full where the other keeps a layer, or more modules of it): its work
   cannot be less, so it is kept only where it was more than 15% faster, and otherwise the fastest
   of the rest is the plan (on 2 shared cores a step of megatron-core's GPTModel with full recompute
   of 3 layers read 4-9% faster than with 2 in the contest's rounds of 2 of 8 quiet processes, and
   6% slower side by side). Before that, the fastest runs more sets of rounds (at most 4) with
   every candidate within 15% whose step over the fastest's, round by round, the rounds cannot yet
   place: the 95% interval of that ratio's median (the sign test's) neither lies above 1.01 (then
   the candidate is out) nor ends at or below it (``contest.median_interval``). On 2 shared cores
   ten rounds were not enough: core attention recomputed on 5 of our GPT's 6 layers, 5.7% slower
   than the fastest plan in 23 of 30 rounds back to back, read within 1% often enough to be
   chosen in 4 of 10 runs. Where others are within 1% of the fastest, the one with the least FLOP
   share of recompute among them, so that a difference the rounds cannot see is decided by what
   does not move (``RecomputePlan.chosen_by``). The time model is a sum of per-layer costs from
   uniform probes, and a mixed plan's step can cost more than that sum (on a CPU one layer's
   core-attention recompute among layers that keep theirs cost 2-4x its uniform share), so the
   plan is never
   clearly slower than megatron-core's best that fits as measured there. Near the budget, rule 5's
   2% margin can shut out a faster plan that does fit (megatron-core's "none" at a budget just above
   its peak): the search and the megatron settings are weighed again without the margin, each such
   plan predicted faster than its guarded counterpart (``RecomputePlan.edges``) runs one
   microbatch's step, and it joins the timed candidates where its prediction, plus what that
   measured step exceeded its one-microbatch prediction by, plus the rest of the headroom fits
   (``search.fits_when_measured``): the measurement of the plan itself stands in for the
   margin.
5. Agreement. Ranks probe their own step; each rank's predicted peak with each option on every
   layer is compared (all_reduce MIN and MAX over the default group) and must agree within 25%
   (one layout, one shape per rank; ranks differ a little legitimately, more so in a small
   model: a context-parallel ring's first rank skips blocks the others compute, the check
   window's agreements run on some ranks' collectives only): otherwise every rank raises the same
   error, naming the option and the range. The plan then uses the largest of every byte
   number and the slowest times, so every rank computes the same plan, and keeps a headroom
   below the budget: the ranks' largest difference plus 2% of the budget (a mixed
   plan's layers differ a little from the uniform probes' means: up to 1.4% under on one CPU
   rank), plus 5% where a step has several microbatches (rule 3's model of the later ones and
   of a pipeline schedule: up to 3.3% under on one CPU rank, 1.0% on pipeline stage 0)
   (:func:`headroom`). The ranks that agree are those of one pipeline stage (its
   tensor x data x context parallel group): each stage has its own plan.
   One probe per option is enough with several CPU ranks too: the collectives see to it that
   the timeline records every free (NOTE [ Frees the CPU profiler records ], in
   parallel_state/handed.py); before they did, gloo's worker thread freed some of their
   tensors unseen and the same step read up to 8% apart from run to run.
6. megatron-core. Its TransformerConfig expresses one recompute for all layers: none, selective
   with one ``recompute_modules`` set (of core_attn, layernorm, mlp: "activation" is this
   package's alone), or full with uniform / block and ``recompute_num_layers`` (with
   ``distribute_saved_activations``). :attr:`RecomputePlan.megatron` is the fastest of those
   that fits by the same prediction (block method: the first n layers full, the rest none), as
   TransformerConfig fields, with its predicted peak and overhead beside the per-layer plan's.
   The uniform method with n > 1 (one checkpoint per n layers) is not weighed: it recomputes
   what n = 1 does (every layer's forward once more), so it is never faster, and it keeps L/n
   inputs instead of L but holds n layers' activations while a group recomputes, so it needs
   less memory than n = 1 only where L/2 inputs outweigh a layer's activations: beyond 34 +
   5as/h layers on one stage with megatron's per-layer count (our GPT, 8 layers, hidden 64,
   seq 256: 20.1 MiB at n = 1, 34.1 at n = 2, +14.1 MiB each n more;
   docs/benchmarks/recompute-planner.md).
   megatron-core's own GPTModel (built through the switch) is probed the same way: its block is
   seen through megatron.MegatronCoreBlock, which sets each option in place (the config's
   full-recompute fields, read at every forward; the layers' selective flags, which its
   TransformerConfig would have set when they were built) and sets the marks with module hooks
   (under full recompute on the checkpoints' outputs). Its options are those megatron-core
   expresses, and its plan is the megatron one: ``apply`` sets those fields in place, and the
   same fields build the model through TransformerConfig.
   (The probe steps and their timelines live in probe.py, the measuring and the ranks'
   agreement in measure.py, the prediction and the search in search.py, the timed contest in
   contest.py, megatron-core's block in megatron.py, :func:`plan_recompute` and
   :func:`choose_plan` in choose.py, :class:`RecomputePlan` in recompute_plan.py.)
7. Scope. Any TP, SP, CP, precision; PP with the 1F1B schedule or the interleaved one, each
   stage planned for its own layers (its chunks alike under interleaving). Stages plan alone;
   where one finds no plan, every rank raises its message (:func:`plan_recompute`).
"""

from megatron_core.tensor_parallel.recompute.planner.choose import (
    choose_plan,
    in_flight_microbatches,
    parse_memory_budget,
    plan_recompute,
)
from megatron_core.tensor_parallel.recompute.planner.measure import (
    candidate_options,
    measure_chunks,
    measure_stage,
)
from megatron_core.tensor_parallel.recompute.planner.recompute_plan import RecomputePlan
from megatron_core.tensor_parallel.recompute.planner.search import (
    OptionMeasure,
    StageMeasure,
    headroom,
    predict_peak,
    schedule_in_flight,
    search_plan,
    smallest_fit,
)

__all__ = [
    # choose.py
    "plan_recompute",
    "choose_plan",
    "parse_memory_budget",
    "in_flight_microbatches",
    # recompute_plan.py
    "RecomputePlan",
    # measure.py
    "candidate_options",
    "measure_stage",
    "measure_chunks",
    # search.py
    "OptionMeasure",
    "StageMeasure",
    "predict_peak",
    "headroom",
    "search_plan",
    "smallest_fit",
    "schedule_in_flight",
]
