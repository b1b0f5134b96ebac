#!/usr/bin/env bash
# The generated kernels' cache hints on the H200, in one call of the `run` tool (carry .devdeps):
# for each OF_CACHE_HINTS value (cuda_source.cpp: 0 plain loads/stores, 1 evict-first loads and
# stores, 2 evict-first stores), the training-loop benchmark (fp32 AdamW, eager and CUDA graph) and
# the mixed-precision benchmark, each against torch in the same process.
# Usage (after dev/h200_training_loop.sh build): dev/h200_cache_hints.sh [hint ...] (default: 0 1 2)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$PWD/.devcache} PYTHONUNBUFFERED=1
for h in ${*:-0 1 2}; do
  echo "== OF_CACHE_HINTS=$h ($(date +%T))" | tee -a "$out/summary.log"
  export OPTFUSE_CUDA_DEFINES="-DOF_CACHE_HINTS=$h"
  timeout ${LOOP_TIMEOUT:-90} python3 bench/training_loop.py --workloads ${LOOP_WORKLOADS:-gpt2-small,llama-1b,many-small} \
    --steps 30 --warmup 5 --json "$out/training_loop_h$h.json" >"$out/training_loop_h$h.txt" 2>&1
  grep -E "optfuse|torch|workload" "$out/training_loop_h$h.txt" | tail -12 | tee -a "$out/summary.log"
  timeout ${MIXED_TIMEOUT:-60} python3 bench/mixed_precision_vs_torch.py --json "$out/mixed_h$h.json" >"$out/mixed_h$h.txt" 2>&1
  tail -12 "$out/mixed_h$h.txt" | tee -a "$out/summary.log"
done
