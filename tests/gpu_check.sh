#!/usr/bin/env bash
# The checks a session runs when it is lent a GPU, in one prepared run (BENCHMARKS.md, "The first GPU"):
#
#     tests/gpu_check.sh [MODEL.gguf] [torch]
#
# run from the repository root with vkdsl importable (PYTHON, default python3). Without a model file
# it writes a random model of the default model's exact shapes and formats (tests/fixtures/shaped.py
# smollm2-135m); `torch` adds PyTorch + PEFT on CUDA beside the training rows
# (tests/fixtures/torch_smollm2_step.py). Each step has its own time limit, so one that hangs
# costs its limit, not the run; every step's output goes to stdout, headed by its name and time.
set -u
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
T0=$(date +%s)
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(( $(date +%s) - T0 )) s)"
  timeout "$limit" "$@" 2>&1
  echo "=== $name rc=$? ($(( $(date +%s) - T0 )) s)"
}
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  TMPD=$(mktemp -d)
  trap 'rm -rf "$TMPD"' EXIT
  MODEL=$TMPD/smollm2-135m-shaped.gguf
  "$PY" "$HERE/tests/fixtures/shaped.py" smollm2-135m "$MODEL" || exit 1
fi
V="$PY -m vkdsl.cli"
step doctor 120 $V doctor --model "$MODEL"
step verify 200 $V verify
step verify-profiles 120 $V verify --match matmul --all-profiles
step matmul 60 $V bench matmul --sizes 1024,2048,4096
step matmul-fp16 60 $V bench matmul --precision fp16 --sizes 1024,2048,4096
step train 150 $V bench train --model "$MODEL"
step train-dpo 90 $V bench train --model "$MODEL" --objective dpo
step by-kernel 120 "$PY" -m vkdsl.train.profile 4x256 qv "$MODEL"
step attention 60 "$PY" -m vkdsl.ops.attention 4 256 9 3 64 --by-kernel
step model 90 $V bench model --model "$MODEL"
if [ "${2:-}" = torch ]; then
  for args in "sft qv 4 256" "sft all 4 256" "dpo qv 4 64"; do
    # shellcheck disable=SC2086
    step "torch $args" 120 "$PY" "$HERE/tests/fixtures/torch_smollm2_step.py" $args "$(nproc)" cuda
  done
fi
echo "done in $(( $(date +%s) - T0 )) s"
