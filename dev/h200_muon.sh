#!/usr/bin/env bash
# Muon's matrix phase in the core on the H200, one `run` call (carry .devdeps): build; all C++ CUDA
# tests (the NewtonSchulz ones among them); the Muon pytest cases with both matrix phases (core:
# cuBLAS; torch: bmm) plus PYTEST_EXTRA; the Muon benchmark against torch.optim.Muon (MUON_ARGS).
# OpenBLAS (the core's CPU products, compared with the GPU's in the tests) is unpacked from the
# Debian packages in .devdeps/ (no network there).
# Usage: dev/h200_muon.sh [part ...]   parts: build cxx python bench (default: all)
set -uo pipefail
parts=${*:-build cxx python bench}
source "$(dirname "$0")/h200_lib.sh"
if ls .devdeps/libopenblas0-pthread_*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/openblas
  for f in .devdeps/libopenblas0-pthread_*.deb .devdeps/libgfortran5_*.deb; do dpkg -x "$f" /tmp/openblas; done
  lib=/tmp/openblas/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$lib/openblas-pthread:$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
build_and_cxx || exit 1
if has python; then
  echo "== pytest ($(date +%T))"
  python3 -c "import optfuse._core as c; print('gemm cpu', c.gemm_available('cpu')); print('gemm cuda', c.gemm_available('cuda'))"
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -s -rfEs --tb=short -p no:cacheprovider tests/python/test_muon.py \
    tests/python/test_zero_muon.py ${PYTEST_EXTRA:-} >"$out/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|Error|assert|max\|dO\||vs torch" "$out/pytest.log" | tail -40
fi
if has bench; then
  echo "== muon vs torch ($(date +%T))"
  timeout ${MUON_TIMEOUT:-300} python3 bench/muon_vs_torch.py --json "$out/muon_vs_torch.json" ${MUON_ARGS:-} 2>&1 | tail -20
fi
echo "== done ($(date +%T))"
