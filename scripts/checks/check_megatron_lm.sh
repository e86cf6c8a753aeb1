#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py, unchanged, with Megatron-LM's default flags, on this
# machine's CPUs through the switch:
#
#   bash scripts/checks/check_megatron_lm.sh MEGATRON_LM_DIR [SCENARIO ...]
#
# MEGATRON_LM_DIR is a Megatron-LM checkout whose tag matches the installed megatron-core
# (core_v0.16.1 with 0.16.1, core_v0.19.0 with 0.19.x); nothing in it is edited. Each run is
#   torchrun --standalone --nproc-per-node N -m megatron_core.megatron DIR/pretrain_gpt.py <flags>
# with a tiny RoPE GPT on mock data and Megatron-LM's defaults otherwise: its default
# --transformer-impl transformer_engine (the switch serves the Transformer Engine stand-in), every
# fusion left on (where a fused kernel needs Transformer Engine, apex or CUDA, megatron-core's
# unfused path or the stand-in runs), the "nccl" backend (the CPU mode serves it with gloo),
# initialization on the "GPU" (docs/guides/megatron-lm-on-a-laptop.md).
# $EXTRA_FLAGS are added to every run (e.g. "--transformer-impl local" for megatron-core's local
# spec). Python: $PYTHON (default python). Logs stay in $OUT (default a temporary folder).
# Prints one line per scenario ("ok" or "FAIL", what was compared, the losses) and exits 1 if any
# failed. Scenarios (all by default):
#   tp1 tp2 sp_tp2 pp2 tp2pp2 dp2   fp32, dropout off, every layout starting from one TP=1
#                            checkpoint (saved after 1 iteration, loaded with --finetune: Megatron
#                            draws a TP shard's initial weights per rank and seeds each pipeline
#                            stage apart, so fresh layouts are different models): losses equal
#                            tp1's to 1e-5 (sp_tp2: TP=2 with sequence parallelism)
#   drop_tp2                 dropout on (0.1), TP=2: the baseline of the next three
#   full_dsa                 full recompute (uniform, 1 layer) with --distribute-saved-activations:
#                            losses equal drop_tp2's as printed (7 digits)
#   selective                selective recompute: losses equal drop_tp2's as printed
#   resume                   saved at iteration 3, resumed from it: iterations 4-6 equal drop_tp2's
#   resume_tp2pp2            the same on 4 ranks, TP=2 x PP=2, against an uninterrupted run
#   bf16_sp                  bf16, TP=2 with sequence parallelism, dropout on: trains
#   bf16_selective           the same with selective recompute: losses equal bf16_sp's as printed
#   bf16_resume              bf16_sp saved at iteration 3 and resumed: iterations 4-6 equal its
# Megatron-LM logs a run's first iteration without resetting its running sum (training.py,
# is_first_iteration), so a run's second loss line is the mean of its first two iterations; the
# comparison undoes that (2 * second - first) and allows that one value the printing's rounding.
set -uo pipefail
MLM="${1:?usage: scripts/checks/check_megatron_lm.sh MEGATRON_LM_DIR [SCENARIO ...]}"
shift
[ -f "$MLM/pretrain_gpt.py" ] || { echo "no pretrain_gpt.py in $MLM"; exit 2; }
MLM="$(cd "$MLM" && pwd)"  # absolute: the script runs from the package's root below
PY="${PYTHON:-python}"
OUT="${OUT:-$(mktemp -d -t megatron_lm_check.XXXXXX)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SCENARIOS=("$@")
[ "${#SCENARIOS[@]}" -gt 0 ] || SCENARIOS=(tp1 tp2 sp_tp2 pp2 tp2pp2 dp2 drop_tp2 full_dsa selective
  resume resume_tp2pp2 bf16_sp bf16_selective bf16_resume)

# A 4-layer GPT (hidden 64, 4 heads, sequence 32, RoPE) on mock data, 6 iterations of a global
# batch of 4. Vocabulary 200: Megatron pads it to a multiple of 128 x TP, and a NullTokenizer adds
# one token under 0.16.1 and none under 0.19, so it is 256 at TP 1 and 2 alike (128 would stay
# 128 at TP 1 under 0.19 and become 256 at TP 2: another model). Constant learning rate, no
# evaluation (--eval-interval: Megatron leaves it None with --eval-iters 0 and then divides by
# it). Nothing else: no --transformer-impl, no --no-*-fusion, no --use-cpu-initialization.
COMMON=(--mock-data --tokenizer-type NullTokenizer --vocab-size 200
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32
  --max-position-embeddings 32 --position-embedding-type rope --micro-batch-size 2
  --global-batch-size 4 --train-iters 6 --lr 1e-3 --lr-decay-style constant --seed 1234
  --log-interval 1 --eval-iters 0 --eval-interval 1000)
read -r -a EXTRA <<< "${EXTRA_FLAGS:-}"
NO_DROPOUT=(--hidden-dropout 0 --attention-dropout 0)

train() {  # train NAME NPROC FLAGS...: run pretrain_gpt.py, keep its log and its losses
  local name="$1" nproc="$2"
  shift 2
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m megatron_core.megatron \
    "$MLM/pretrain_gpt.py" "${COMMON[@]}" "${EXTRA[@]}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  # "iteration        3/       6 | ... | lm loss: 5.389359E+00 |" -> "3 5.389359E+00"
  sed -n 's/.*iteration *\([0-9]*\)\/ *[0-9]* |.*lm loss: \([0-9.E+-]*\) |.*/\1 \2/p' \
    "$OUT/$name.log" > "$OUT/$name.loss"
  return $rc
}

compare() {  # compare NAME REFERENCE TOLERANCE [FROM]: one line, ok or FAIL
  "$PY" - "$OUT" "$1" "$2" "$3" "${4:-1}" <<'PY'
import sys
out, name, ref, tol, first = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])

def losses(n):
    """iteration -> (loss, derived): the second line of a run undone (see the header)."""
    rows = [(int(i), v) for i, v in (line.split() for line in open(f"{out}/{n}.loss"))]
    values = {i: (float(v), False) for i, v in rows}
    if len(rows) > 1:
        (a, first_value), (b, second_value) = rows[0], rows[1]
        values[b] = (2 * float(second_value) - float(first_value), True)
    return {i: v for i, v in values.items() if i >= first}

got, want = losses(name), losses(ref)
if not want or sorted(got) != sorted(want):
    print(f"FAIL {name}: iterations {sorted(got)} vs {ref}'s {sorted(want)} (log: {out}/{name}.log)")
    sys.exit(1)
# As printed: equal digits, or within the rounding of 7 printed digits for an undone value.
slack = {i: (2e-6 * abs(want[i][0]) if got[i][1] or want[i][1] else 0.0) for i in want}
diffs = {i: abs(got[i][0] - want[i][0]) for i in want}
same = all(diffs[i] <= max(tol, slack[i]) for i in want)
how = "as printed" if tol == 0 else f"to {tol:g}"
shown = " ".join(f"{got[i][0]:.6f}" for i in sorted(got))
print(f"{'ok  ' if same else 'FAIL'} {name}: iterations {min(want)}-{max(want)} equal {ref}'s "
      f"{how} (largest difference {max(diffs.values()):.1e}); lm loss {shown}")
sys.exit(0 if same else 1)
PY
}

failed=0
report() {  # report NAME RC [compare args...]
  local name="$1" rc="$2"
  shift 2
  if [ "$rc" -ne 0 ] || [ ! -s "$OUT/$name.loss" ]; then
    echo "FAIL $name: pretrain_gpt.py exited $rc (log: $OUT/$name.log)"
    tail -5 "$OUT/$name.log" | sed 's/^/     /'
    failed=1
    return
  fi
  if [ "$#" -eq 0 ]; then
    echo "ok   $name: trained $(wc -l < "$OUT/$name.loss") iterations; lm loss $(awk '{printf "%s ", $2}' "$OUT/$name.loss")"
  else
    compare "$name" "$@" || failed=1
  fi
}

needs() {  # needs NAME: run scenario NAME first unless it has run
  [ -s "$OUT/$1.loss" ] || run_scenario "$1"
}

FROM_INIT=(--load "$OUT/ckpt_init" --finetune --no-load-optim --no-load-rng)

run_scenario() {
  case "$1" in
    init) rm -rf "$OUT/ckpt_init"
      train init 1 "${NO_DROPOUT[@]}" --train-iters 1 --save "$OUT/ckpt_init" --save-interval 1
      report init $? ;;
    tp1) needs init; train tp1 1 "${NO_DROPOUT[@]}" "${FROM_INIT[@]}"; report tp1 $? ;;
    tp2) needs tp1
      train tp2 2 "${NO_DROPOUT[@]}" "${FROM_INIT[@]}" --tensor-model-parallel-size 2
      report tp2 $? tp1 1e-5 ;;
    sp_tp2) needs tp1
      train sp_tp2 2 "${NO_DROPOUT[@]}" "${FROM_INIT[@]}" --tensor-model-parallel-size 2 \
        --sequence-parallel
      report sp_tp2 $? tp1 1e-5 ;;
    pp2) needs tp1
      train pp2 2 "${NO_DROPOUT[@]}" "${FROM_INIT[@]}" --pipeline-model-parallel-size 2
      report pp2 $? tp1 1e-5 ;;
    tp2pp2) needs tp1
      train tp2pp2 4 "${NO_DROPOUT[@]}" "${FROM_INIT[@]}" --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2
      report tp2pp2 $? tp1 1e-5 ;;
    dp2) needs tp1; train dp2 2 "${NO_DROPOUT[@]}" "${FROM_INIT[@]}"; report dp2 $? tp1 1e-5 ;;
    drop_tp2) train drop_tp2 2 --tensor-model-parallel-size 2; report drop_tp2 $? ;;
    full_dsa) needs drop_tp2
      train full_dsa 2 --tensor-model-parallel-size 2 --recompute-granularity full \
        --recompute-method uniform --recompute-num-layers 1 --distribute-saved-activations
      report full_dsa $? drop_tp2 0 ;;
    selective) needs drop_tp2
      train selective 2 --tensor-model-parallel-size 2 --recompute-granularity selective
      report selective $? drop_tp2 0 ;;
    resume) needs drop_tp2
      rm -rf "$OUT/ckpt_tp2"
      train resume_first 2 --tensor-model-parallel-size 2 --save "$OUT/ckpt_tp2" \
        --save-interval 3 --exit-interval 3
      local rc=$?
      if [ "$rc" -eq 0 ]; then
        train resume 2 --tensor-model-parallel-size 2 --load "$OUT/ckpt_tp2"
        rc=$?
      fi
      report resume $rc drop_tp2 0 4 ;;
    resume_tp2pp2)
      local par=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2)
      rm -rf "$OUT/ckpt_tp2pp2"
      train drop_tp2pp2 4 "${par[@]}"
      local rc=$?
      [ "$rc" -eq 0 ] && { train resume_tp2pp2_first 4 "${par[@]}" --save "$OUT/ckpt_tp2pp2" \
        --save-interval 3 --exit-interval 3; rc=$?; }
      [ "$rc" -eq 0 ] && { train resume_tp2pp2 4 "${par[@]}" --load "$OUT/ckpt_tp2pp2"; rc=$?; }
      report resume_tp2pp2 $rc drop_tp2pp2 0 4 ;;
    bf16_sp) train bf16_sp 2 --bf16 --tensor-model-parallel-size 2 --sequence-parallel
      report bf16_sp $? ;;
    bf16_selective) needs bf16_sp
      train bf16_selective 2 --bf16 --tensor-model-parallel-size 2 --sequence-parallel \
        --recompute-granularity selective
      report bf16_selective $? bf16_sp 0 ;;
    bf16_resume) needs bf16_sp
      local bf=(--bf16 --tensor-model-parallel-size 2 --sequence-parallel)
      rm -rf "$OUT/ckpt_bf16"
      train bf16_resume_first 2 "${bf[@]}" --save "$OUT/ckpt_bf16" --save-interval 3 \
        --exit-interval 3
      local rc=$?
      [ "$rc" -eq 0 ] && { train bf16_resume 2 "${bf[@]}" --load "$OUT/ckpt_bf16"; rc=$?; }
      report bf16_resume $rc bf16_sp 0 4 ;;
    *) echo "FAIL $1: no such scenario"; failed=1 ;;
  esac
}

echo "Megatron-LM: $MLM ($(git -C "$MLM" describe --tags 2>/dev/null || echo "no git tag")); logs: $OUT"
"$PY" -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "megatron-core", m.version("megatron-core"))'
for scenario in "${SCENARIOS[@]}"; do
  [ -s "$OUT/$scenario.loss" ] || run_scenario "$scenario"
done
exit $failed
