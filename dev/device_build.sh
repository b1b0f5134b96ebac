#!/usr/bin/env bash
# Builds optfuse and its C++ tests on the lent H200 machine (no network there): GoogleTest comes
# from Debian packages carried in .devdeps/ (see dev/README.md). Usage: dev/device_build.sh [build dir]
set -euo pipefail
build=${1:-build-device}
if [ ! -d /tmp/gtest/usr ]; then
  mkdir -p /tmp/gtest
  for f in .devdeps/libgtest-dev_*.deb; do dpkg -x "$f" /tmp/gtest; done
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGTest_DIR=/tmp/gtest/usr/lib/x86_64-linux-gnu/cmake/GTest -DGTEST_ROOT=/tmp/gtest/usr >/dev/null
cmake --build "$build" -j16
