#!/usr/bin/env bash
# The CUDA / NCCL checks for a machine with one or more NVIDIA GPUs, sized for a lent
# machine: one GPU, 16 cores, its own torch, nothing installable, minutes of device time.
#
#   bash scripts/checks/gpu_check.sh                 # every step, most valuable first
#   bash scripts/checks/gpu_check.sh train checks    # only these steps, in this order
#   bash scripts/checks/gpu_check.sh --dry-run       # no GPU: check that every step's script is there
#                                             # and compiles, print the commands (CI runs this)
#
# Run from anywhere; it runs the package from this work tree (PYTHONPATH). A pure-Python package
# the machine lacks travels as wheels in .whl/ (megatron-core for the suite's megatron tests):
# they are installed into /tmp/site first. Results go to $OUT (default ./gpu_check_out), each
# step's log as soon as it ends, and one line per step (exit status, seconds, the result lines)
# in $OUT/summary.log, so a run cut short still returns what ran. At most 9 files are written.
#
# Steps, in the default order:
#   bench_mlp  scripts/benchmarks/benchmark_mlp_cuda.py: ColumnParallel -> RowParallel MLP in bf16 at hidden
#              4096 and 8192 (TFLOP/s, share of the measured GEMM peak, allocator peak), against
#              torch nn.Linear, with our / torch's checkpoint, checks always vs off. Runs alone.
#   attention  scripts/checks/check_attention_cuda.py: the SDPA kernel each attention case chose, fused
#              against unfused (core, context-parallel blocks, dropout under recompute), and our
#              GPT's tokens/s fused vs unfused at hidden 2048, s = 4096, bf16. Runs alone.
#   tests      the suite in the harness's CUDA mode (MEGATRON_CORE_TEST_DEVICE=cuda): world size
#              1 on NCCL, larger worlds share the GPU over gloo (harness rule 7); in the
#              background, pytest-xdist when present, beside the next steps. Environment:
#              GPU_CHECK_TESTS (paths, default tests), GPU_CHECK_TESTS_LIMIT_S (default 300),
#              GPU_CHECK_TESTS_WORKERS (xdist workers, default 8).
#   checks     scripts/checks/check_tensor_parallel_cuda.py, check_pipeline_cuda.py and
#              check_parallel_state_nccl.py, one rank (NCCL).
#   train      the main job with --device cuda --bf16: 300 iterations saved at 150 and 300; a run
#              resumed from 150 must end with bitwise the same checkpoint; the GPU's checkpoint
#              then loads at TP 2 on two CPU ranks (gloo) and trains on.
#   drift      scripts/benchmarks/precision_drift.py on the GPU (bf16 / fp16 loss drift vs fp32).
#   cp         scripts/checks/check_context_parallel_cuda.py: context-parallel attention (p2p,
#              all_gather, a2a) at CP=2 in bf16 against CP=1; two processes, NCCL on two GPUs,
#              gloo sharing the GPU on one.
#   plan       scripts/checks/check_recompute_plan_cuda.py: the recompute planner's predicted peak
#              against torch.cuda.max_memory_allocated for the plans it emits from the
#              no-recompute peak down to the smallest that fits (bf16 autocast, one GPU).
set -u
cd "$(dirname "$0")/../.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
ALL_STEPS="bench_mlp attention tests checks train drift cp plan"
STEPS="${*:-$ALL_STEPS}"
for s in $STEPS; do
  case " $ALL_STEPS " in *" $s "*) ;; *) echo "gpu_check: unknown step '$s' (steps: $ALL_STEPS)" >&2; exit 2 ;; esac
done
OUT="${OUT:-$PWD/gpu_check_out}"
PY="${PYTHON:-python3}"
TESTS_LIMIT_S="${GPU_CHECK_TESTS_LIMIT_S:-300}"  # the suite's share of a 10-minute call
TESTS="${GPU_CHECK_TESTS:-tests}"  # test files or folders for the tests step

SCRIPTS="scripts/benchmarks/benchmark_mlp_cuda.py scripts/checks/check_tensor_parallel_cuda.py scripts/checks/check_pipeline_cuda.py
scripts/checks/check_parallel_state_nccl.py scripts/train_gpt.py scripts/benchmarks/precision_drift.py
scripts/checks/check_context_parallel_cuda.py scripts/checks/check_recompute_plan_cuda.py
scripts/checks/check_attention_cuda.py"
if [ "$DRY" = 1 ]; then
  for f in $SCRIPTS; do
    [ -f "$f" ] || { echo "gpu_check --dry-run: $f is missing" >&2; exit 1; }
  done
  # shellcheck disable=SC2086
  "$PY" -m py_compile $SCRIPTS || exit 1
  echo "gpu_check --dry-run: steps $STEPS; scripts present and compiling: $(echo $SCRIPTS)"
  exit 0
fi

mkdir -p "$OUT"
SUMMARY="$OUT/summary.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=1  # the overlapped linear backward (NOTE in tensor_parallel/linear/autograd.py)
{
  echo "gpu_check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null), steps: $STEPS"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
  "$PY" -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -n 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
} >> "$SUMMARY" 2>&1

note() {  # note NAME RC START LOG PATTERN: one summary line and the log's result lines
  echo "== $1: exit $2, $((SECONDS - $3)) s" >> "$SUMMARY"
  grep -E "$5" "$4" | tail -n 60 >> "$SUMMARY"
}

run_logged() {  # run_logged LOG LIMIT_S COMMAND...: append the command and its output to LOG
  local log="$1" limit="$2"
  shift 2
  echo "+ $*" >> "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "+ exit $rc" >> "$log"
  return $rc
}

step_bench_mlp() {
  local log="$OUT/bench_mlp.log" start=$SECONDS
  run_logged "$log" 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    scripts/benchmarks/benchmark_mlp_cuda.py --hidden 4096,8192 --tokens 8192 --iters 20
  note bench_mlp $? $start "$log" "^\||^hidden|MISMATCH|Error"
}

step_attention() {
  local log="$OUT/attention.log" start=$SECONDS
  run_logged "$log" 240 "$PY" scripts/checks/check_attention_cuda.py
  note attention $? $start "$log" "^attention|^our GPT|^\||FAIL|Error"
}

TESTS_PID=""
step_tests() {  # starts the suite in the background; finish_tests waits for it
  local log="$OUT/tests_cuda.log" parallel=()
  if "$PY" -c "import xdist" 2>/dev/null; then
    parallel=(-n "${GPU_CHECK_TESTS_WORKERS:-8}")
  fi
  TESTS_START=$SECONDS
  (
    # shellcheck disable=SC2086
    MEGATRON_CORE_TEST_DEVICE=cuda run_logged "$log" "$TESTS_LIMIT_S" "$PY" -m pytest $TESTS -q \
      -v --tb=short -rfEs -p megatron_core.megatron.pytest_plugin --timeout=240 "${parallel[@]}"
  ) &
  TESTS_PID=$!
}

finish_tests() {
  [ -n "$TESTS_PID" ] || return 0
  wait "$TESTS_PID"
  note tests $? "$TESTS_START" "$OUT/tests_cuda.log" \
    "[0-9]+ passed|[0-9]+ failed|^FAILED|^ERROR|^SKIPPED|Timeout|^\+ exit"
  TESTS_PID=""
}

step_checks() {
  local log="$OUT/checks.log" start=$SECONDS rc=0 f
  for f in check_tensor_parallel_cuda check_pipeline_cuda check_parallel_state_nccl; do
    run_logged "$log" 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
      "scripts/checks/$f.py" || rc=1
  done
  note checks $rc $start "$log" "^world|OK|FAIL|mismatch|Error|^\+ exit"
}

step_train() {
  local log="$OUT/train.log" start=$SECONDS rc=0 ck=/tmp/gpu_check_ckpt
  rm -rf "$ck"
  local common=(--device cuda --bf16 --tensor-model-parallel-size 1 --log-interval 50)
  run_logged "$log" 200 "$PY" scripts/train_gpt.py "${common[@]}" --train-iters 300 \
    --save "$ck/straight" --save-interval 150 || rc=1
  run_logged "$log" 200 "$PY" scripts/train_gpt.py "${common[@]}" --train-iters 300 \
    --load "$ck/straight" --ckpt-step 150 --save "$ck/resumed" --save-interval 150 || rc=1
  run_logged "$log" 120 "$PY" - "$ck/straight/iter_0000300" "$ck/resumed/iter_0000300" <<'PY' || rc=1
import sys, tempfile, os
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flat(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), tree

states = []
for d in sys.argv[1:]:
    out = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    dcp_to_torch_save(d, out)
    states.append(dict(flat(torch.load(out, weights_only=False))))
a, b = states
tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
differ = [k for k in tensors if not torch.equal(a[k], b.get(k))]
print(f"resume: {len(tensors)} tensors in the iteration-300 checkpoints, {len(differ)} differ",
      "(bitwise equal)" if not differ and a.keys() == b.keys() else differ[:10])
sys.exit(1 if differ or a.keys() != b.keys() else 0)
PY
  run_logged "$log" 200 "$PY" scripts/train_gpt.py --device cpu --bf16 --nproc-per-node 2 \
    --tensor-model-parallel-size 2 --load "$ck/straight" --train-iters 320 --log-interval 10 \
    || rc=1
  note train $rc $start "$log" "^train_gpt|^iteration|^done|^resume|loaded|Error|error|^\+ exit"
}

step_drift() {
  local log="$OUT/drift.log" start=$SECONDS
  run_logged "$log" 200 "$PY" scripts/benchmarks/precision_drift.py --device cuda --tp 1
  note drift $? $start "$log" "^\||iterations|Error|error"
}

step_cp() {
  local log="$OUT/cp.log" start=$SECONDS
  run_logged "$log" 200 "$PY" scripts/checks/check_context_parallel_cuda.py
  note cp $? $start "$log" "^cp=|FAIL|Error"
}

step_plan() {
  local log="$OUT/plan.log" start=$SECONDS
  run_logged "$log" 200 "$PY" scripts/checks/check_recompute_plan_cuda.py
  note plan $? $start "$log" "^\||bf16 autocast|FAIL|Error"
}

for s in $STEPS; do
  "step_$s"
done
finish_tests
echo "== done in $SECONDS s" >> "$SUMMARY"
cat "$SUMMARY"
