#!/usr/bin/env bash
# Adafactor's row and column scopes on the H200 in one `run` call (carry .devdeps): build, the C++
# CUDA tests, the Adafactor and optim_db pytest cases on CUDA, the training-loop never-wait checks,
# then Adafactor, AdamW and Lamb against torch (bench/optimizers_vs_torch.py; BENCH_OPTIMIZERS, BENCH_WORKLOADS) and the
# kernels' times of PROFILE_OPTIMIZERS (default Adafactor Lamb; dev/kernel_times.py, torch profiler).
# Usage: dev/h200_adafactor.sh [part ...]   parts: build cxx python bench profile (default: all)
set -uo pipefail
parts=${*:-build cxx python bench profile}
source "$(dirname "$0")/h200_lib.sh"
build_and_cxx || exit 1  # build and test_cuda: the training-loop script's parts of those names
if has python; then
  echo "== pytest ($(date +%T))"
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/python/test_adafactor.py \
    tests/python/test_optim_db.py tests/python/test_training_loop.py -k "Adafactor or adafactor or cuda or never_wait" \
    >"$out/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|Error|assert" "$out/pytest.log" | tail -30
fi
if has bench; then
  echo "== ${BENCH_OPTIMIZERS:=Adafactor,AdamW,Lamb} vs torch ($(date +%T))"
  timeout 300 python3 bench/optimizers_vs_torch.py --optimizers "$BENCH_OPTIMIZERS" --workloads "${BENCH_WORKLOADS:-llama-1b,gpt2-small}" \
    --json "$out/adafactor_vs_torch.json" 2>&1 | tail -24
fi
if has profile; then
  # each pass's time against its own floor (OPTFUSE_CUDA_DEFINES may set the generated source's knobs)
  for opt in ${PROFILE_OPTIMIZERS:-Adafactor Lamb}; do
    echo "== $opt kernels, llama-1b, defines '${OPTFUSE_CUDA_DEFINES:-}' ($(date +%T))"
    timeout 200 python3 dev/kernel_times.py --optimizer "$opt" --workload llama-1b 2>&1 | grep -v Warn | tail -9
  done
fi
echo "== done ($(date +%T))"
