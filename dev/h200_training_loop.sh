#!/usr/bin/env bash
# The training-loop issue's checks on the H200 in one call of the `run` tool (carry .devdeps):
#   build; C++ CUDA tests; the Python suite (CUDA available, failures summarised); the training-loop
#   benchmark against torch (host time, never-waits check, GPU time, CUDA graph; --compile optional);
#   optimizers: bench/optimizers_vs_torch.py (OPT_ARGS); mixed: bench/mixed_precision_vs_torch.py;
#   muon: bench/muon_vs_torch.py (MUON_ARGS); traced: bench/traced_vs_original.py.
# Usage: dev/h200_training_loop.sh [part ...]
#   parts: build cxx python bench optimizers mixed muon traced compile (default: build cxx python bench)
set -uo pipefail
parts=${*:-build cxx python bench}
source "$(dirname "$0")/h200_lib.sh"
step() { echo "== $* ($(date +%T))" | tee -a "$out/summary.log"; }
if has build; then
  step build
  dev/device_build.sh >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  python3 -m pip install -q --no-build-isolation --no-deps . >"$out/pip.log" 2>&1 || tail -30 "$out/pip.log"
  # third-party optimizers for the tracing tests and benchmark (no network there: wheels in .devdeps)
  ls .devdeps/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --no-index .devdeps/*.whl >>"$out/pip.log" 2>&1
fi
if has cxx; then
  step test_cuda
  timeout 240 ./build-device/test_cuda >"$out/test_cuda.log" 2>&1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|exception" "$out/test_cuda.log" | tail -30 | tee -a "$out/summary.log"
fi
if has python; then
  step "pytest (CUDA available)"
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider ${PYTEST_ARGS:-tests/python} >"$out/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -40 | tee -a "$out/summary.log"
fi
# bench PART TITLE TIMEOUT SCRIPT JSON [ARGS...]: one benchmark part, its table in summary.log
bench() {
  local part=$1 title=$2 limit=$3 script=$4 json=$5
  shift 5
  has "$part" || return 0
  step "$title"
  timeout "$limit" python3 "bench/$script" --json "$out/$json" "$@" 2>&1 | tee -a "$out/summary.log"
}
bench bench "training loop vs torch" "${BENCH_TIMEOUT:-200}" training_loop.py training_loop.json ${BENCH_ARGS:-}
bench optimizers "optimizers vs torch" "${OPT_TIMEOUT:-240}" optimizers_vs_torch.py optimizers_vs_torch.json ${OPT_ARGS:-}
bench mixed "mixed precision vs torch" "${MIXED_TIMEOUT:-200}" mixed_precision_vs_torch.py mixed_precision_vs_torch.json
bench muon "muon vs torch" "${MUON_TIMEOUT:-200}" muon_vs_torch.py muon_vs_torch.json ${MUON_ARGS:-}
bench traced "traced optimizers vs their originals" "${TRACED_TIMEOUT:-200}" traced_vs_original.py traced_vs_original.json
bench compile "training loop, torch.compile" 240 training_loop.py training_loop_compile.json --workloads gpt2-small --compile
step done
