#!/usr/bin/env bash
# The CUDA backend's checks on a lent H200 (run through the `run` tool with carry=[".devdeps"], and
# ".devcache" if you have one, see below):
#   1. build with dev/device_build.sh (GoogleTest from the .deb files in .devdeps/)
#   2. ./build-device/test_cuda: the CUDA run-time layer and backend tests, GPU ones included
#   3. `optfuse check --backend cuda` for a few chains and dtypes
#   4. the disabled bandwidth benchmark (CudaBench.*) for the default kernel shape; with --tune also
#      for a few variants (OPTFUSE_CUDA_DEFINES: OF_UNROLL_32/OF_UNROLL_16 vectors per role per pass,
#      OF_MIN_BLOCKS blocks per SM)
# Logs go to $OUT (the run tool's folder) or ./out. Usage: dev/h200_cuda_check.sh [--no-bench|--tune]
#
# Compiled kernels are cached under $XDG_CACHE_HOME/optfuse; pointing it at a carried .devcache
# (filled on any machine with the same NVRTC, e.g. by running test_cuda there) saves the NVRTC time.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$PWD/.devcache}
status=0
step() { echo "== $* ($(date +%T))" | tee -a "$out/summary.log"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | tee -a "$out/summary.log"

step "build"
if ! dev/device_build.sh >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "BUILD FAILED" | tee -a "$out/summary.log"
  exit 1
fi

step "test_cuda"
timeout 200 ./build-device/test_cuda >"$out/test_cuda.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|worst|error" "$out/test_cuda.log" | head -60 | tee -a "$out/summary.log"

step "optfuse check --backend cuda"
for spec in "adamw(lr=1e-2, weight_decay=0.1)" "chain(clip_by_global_norm(1.0), adamw())" \
            "chain(unscale_by_grad_scale(), skip_if_nonfinite(), adam())" "lion(weight_decay=0.1)" \
            "sgd(momentum=0.9, nesterov=true)"; do
  for dtype in float32 bfloat16 float16; do
    if timeout 30 ./build-device/optfuse check "$spec" --backend cuda --dtype "$dtype" >>"$out/check.log" 2>&1; then
      echo "ok    $spec $dtype: $(tail -1 "$out/check.log")" | tee -a "$out/summary.log"
    else
      status=1
      echo "FAIL  $spec $dtype: $(tail -1 "$out/check.log")" | tee -a "$out/summary.log"
    fi
  done
done

if [ "${1:-}" != "--no-bench" ]; then
  step "bandwidth (CudaBench)"
  variants=("")
  [ "${1:-}" = "--tune" ] && variants+=("-DOF_MIN_BLOCKS=4" "-DOF_MIN_BLOCKS=6" "-DOF_UNROLL_32=2 -DOF_UNROLL_16=2 -DOF_MIN_BLOCKS=2")
  for defines in "${variants[@]}"; do
    echo "-- OPTFUSE_CUDA_DEFINES='$defines'" | tee -a "$out/summary.log"
    OPTFUSE_CUDA_DEFINES="$defines" timeout 60 ./build-device/test_cuda --gtest_also_run_disabled_tests \
      --gtest_filter='CudaBench.*' >>"$out/bench.log" 2>&1 || status=1
    grep "^BENCH" "$out/bench.log" | tail -13 | tee -a "$out/summary.log"  # this variant's 13 lines
  done
fi
step "done (status $status)"
exit $status
