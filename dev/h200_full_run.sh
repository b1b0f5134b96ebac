#!/usr/bin/env bash
# Everything the issues ask to be shown on the H200, in one call of the `run` tool (carry .devdeps):
#   build; C++ CUDA tests; the Python suite on CUDA tensors; host overhead per step; the CUDA
#   benchmark against torch (fused, fused in a CUDA graph, torch.compile, clip + AdamW, bf16); the
#   CPU benchmark against torch on the host's cores. Logs and JSON go to $OUT (or ./out).
# Usage: dev/h200_full_run.sh [part ...]   parts: build cxx python bench cpu (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$PWD/.devcache} PYTHONUNBUFFERED=1
parts=${*:-build cxx python bench cpu}
has() { [[ " $parts " == *" $1 "* ]]; }
step() { echo "== $* ($(date +%T))" | tee -a "$out/summary.log"; }

step "device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/summary.log"
nproc | tee -a "$out/summary.log"
if has build; then
  step build
  dev/device_build.sh >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi
if has cxx; then
  step test_cuda
  timeout 240 ./build-device/test_cuda >"$out/test_cuda.log" 2>&1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure" "$out/test_cuda.log" | tail -30 | tee -a "$out/summary.log"
fi
if has python; then
  step "pip install ."
  python3 -m pip install -q --no-build-isolation --no-deps . >"$out/pip.log" 2>&1 || tail -30 "$out/pip.log"
  step "pytest (CUDA available)"
  timeout 200 python3 -m pytest -q tests/python -p no:cacheprovider >"$out/pytest.log" 2>&1
  tail -15 "$out/pytest.log" | tee -a "$out/summary.log"
  step "host overhead"
  timeout 60 python3 tests/python/overhead.py --device cuda 2>&1 | tee -a "$out/summary.log"
fi
if has bench; then
  step "cuda vs torch"
  timeout 330 python3 bench/cuda_vs_torch.py --optfuse build-device/optfuse --compile --bf16 \
    --json "$out/cuda_vs_torch.json" 2>"$out/cuda_bench_stderr.log" | tee -a "$out/summary.log"
fi
if has cpu; then
  step "cpu vs torch"
  timeout 120 python3 bench/cpu_vs_torch.py --optfuse build-device/optfuse --json "$out/cpu_vs_torch.json" \
    2>"$out/cpu_bench_stderr.log" | tee -a "$out/summary.log"
fi
step done
