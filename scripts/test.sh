#!/usr/bin/env bash
# Every test: sets up, builds, runs the C++ suites (ctest), the install check (an outside project
# using find_package(optfuse)), then installs the Python package and runs pytest. Tests that need a
# GPU skip with a reason where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
# CMake finds the CUDA toolkit (headers for types, NVRTC) through nvcc on PATH.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
scripts/setup.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
tests/install/run_install_test.sh
python3 -m pip install -q --no-build-isolation .
python3 -m pytest -q tests/python
