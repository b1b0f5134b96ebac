#!/usr/bin/env bash
# Every test: sets up, builds, runs the C++ suites (ctest), the same suites under ASan/UBSan
# (build-asan), the install check (an outside project using find_package(optfuse)), then installs
# the Python package and runs pytest, then the front end's pointer cases under the sanitizers
# (scripts/asan_python.sh). Tests that need a GPU skip with a reason where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
# CMake finds the CUDA toolkit (headers for types, NVRTC) through nvcc on PATH.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
scripts/setup.sh
scripts/build.sh
# scripts/ctest.sh: ctest, then each skipped test with the reason it gave (ctest alone prints
# only "***Skipped").
scripts/ctest.sh --test-dir build --output-on-failure -j"$(nproc)"
# The C++ suites again, built with AddressSanitizer (+LeakSanitizer) and UndefinedBehaviorSanitizer
# in build-asan, optimised with debug info so that the suites stay fast (still, on 2 cores the build
# and the suites each take minutes). The kernels the CPU backend compiles at run time are not
# instrumented.
# protect_shadow_gap=0: the CUDA driver maps memory where ASan reserves its shadow gap, so on a GPU
# host cuInit fails (CUDA_ERROR_OUT_OF_MEMORY) and the GPU tests would skip; with it they run
# (checked on an H200). Without a GPU it changes nothing.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DOPTFUSE_SANITIZE=address,undefined >/dev/null
cmake --build build-asan
ASAN_OPTIONS=detect_leaks=1:protect_shadow_gap=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  scripts/ctest.sh --test-dir build-asan --output-on-failure -j"$(nproc)"
tests/install/run_install_test.sh
python3 -m pip install -q --no-build-isolation .
# -rs: every skipped test with its reason in the summary.
# The build above had torch importable: optfuse._torch_reader must be there (test_torch_reader.py).
OPTFUSE_EXPECT_TORCH_READER=1 python3 -m pytest -q -rs tests/python
# The torch front end's pointer and size cases again, with the extension and the tensor reader built
# with ASan/UBSan in build-asan (a report fails the run).
scripts/asan_python.sh
