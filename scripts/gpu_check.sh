#!/usr/bin/env bash
# The CUDA checks of issue 11, point 4, for a machine with at least one NVIDIA GPU.
#
#   bash scripts/gpu_check.sh            # from the repository root; writes $OUT/summary.log
#
# Steps (each logged to $OUT/<step>.log; a failing step does not stop the others):
#   1. the test suite in the harness's CUDA mode (MEGATRON_CORE_TEST_DEVICE=cuda: NCCL for CUDA
#      tensors, gloo for CPU ones, one GPU per rank; world sizes above the GPU count are skipped
#      with a reason naming both numbers);
#   2. the main job on the GPU in bf16 and in fp16 (TP 1, 100 iterations, default model);
#   3. scripts/precision_drift.py on the GPU (TP 1): bf16/fp16 loss drift vs fp32;
#   4. the GPU columns of the benchmarks (activation memory, checkpoint modes) in bf16.
# $OUT defaults to ./gpu_check_out. summary.log gets one line per step (exit status, seconds)
# plus the lines of each log that carry the results.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1  # the overlapped linear backward (NOTE in linear_impl.py)

{
  echo "gpu_check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null)"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
} > "$SUMMARY" 2>&1

step() {  # step NAME GREP_PATTERN COMMAND...
  local name="$1" pattern="$2"
  shift 2
  local start=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc, $((SECONDS - start)) s: $*" >> "$SUMMARY"
  grep -E "$pattern" "$OUT/$name.log" | tail -n 40 >> "$SUMMARY"
}

step tests_cuda "passed|failed|error|SKIPPED|FAILED" \
  env MEGATRON_CORE_TEST_DEVICE=cuda python -m pytest tests -q -rs --timeout=1800
step train_bf16 "^train_gpt|^iteration|^done|Error|error" \
  python scripts/train_gpt.py --device cuda --bf16 --tensor-model-parallel-size 1 \
    --train-iters 100 --log-interval 20
step train_fp16 "^train_gpt|^iteration|^done|^fp16|skipped|Error|error" \
  python scripts/train_gpt.py --device cuda --fp16 --tensor-model-parallel-size 1 \
    --train-iters 100 --log-interval 20
step precision_drift "^\||iterations|Error|error" \
  python scripts/precision_drift.py --device cuda --tp 1
step bench_activation_memory "^\||Error|error" \
  torchrun --standalone --nproc_per_node=1 scripts/benchmark_activation_memory.py \
    --device cuda --tp 1 --dtype bf16
step bench_checkpoint "^\||Error|error" \
  torchrun --standalone --nproc_per_node=1 scripts/benchmark_checkpoint.py \
    --device cuda --tp 1 --seq 2048 --batch 4 --hidden 2048 --heads 16 --dtype bf16

cat "$SUMMARY"
