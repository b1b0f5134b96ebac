#!/usr/bin/env bash
# Issue 30's checks on the H200 in one or two calls of the `run` tool (carry .devdeps, and .oldtree
# for the baseline: `git archive <commit> | tar -x -C .oldtree`):
#   build     dev/device_build.sh + the Python package (and the third-party wheels of .devdeps)
#   cxx       the C++ CUDA tests (test_cuda)
#   python    pytest over tests/python with CUDA available (PYTEST_ARGS, PYTEST_TIMEOUT)
#   bench     bench/training_loop.py (host time per step in the loop users write) on this tree
#   baseline  the same benchmark on .oldtree's build, installed under /tmp/oldsite (same machine, same call)
# Usage: dev/h200_issue30.sh [part ...]   (default: build cxx python)
set -uo pipefail
parts=${*:-build cxx python}
source "$(dirname "$0")/h200_lib.sh"
step() { echo "== $* ($(date +%T))" | tee -a "$out/summary.log"; }
build_and_cxx
if has python; then
  step "pytest (CUDA available)"
  timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --durations=15 \
    ${PYTEST_ARGS:-tests/python} >"$out/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -60 | tee -a "$out/summary.log"
fi
BENCH="--workloads ${BENCH_WORKLOADS:-gpt2-small,many-small} --steps 50"
if has bench; then
  step "training loop, this tree"
  timeout 240 python3 bench/training_loop.py $BENCH --json "$out/training_loop_new.json" 2>&1 | tee -a "$out/summary.log"
fi
if has baseline; then
  step "training loop, baseline (.oldtree)"
  (cd .oldtree && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/oldsite . >"$out/old_pip.log" 2>&1) \
    || tail -20 "$out/old_pip.log"
  PYTHONPATH=/tmp/oldsite timeout 240 python3 bench/training_loop.py $BENCH --json "$out/training_loop_old.json" 2>&1 \
    | tee -a "$out/summary.log"
fi
step done
