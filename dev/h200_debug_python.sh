#!/usr/bin/env bash
# Native backtrace of a crash in the Python extension on the device (cuda-gdb debugs host code too).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}; mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps . >"$out/pip.log" 2>&1 || tail -20 "$out/pip.log"
python3 -c "import nanobind, sys; print('nanobind', nanobind.__version__, sys.version)"
g++ --version | head -1
cd /tmp
python3 -c "import optfuse; print('no torch:', len(optfuse.explain('adamw()')))" 2>&1 | tail -3
python3 -c "import torch, optfuse; print('with torch:', len(optfuse.explain('adamw()')))" 2>&1 | tail -3
cuda-gdb -batch -ex run -ex bt --args python3 -c "import torch, optfuse; print(len(optfuse.explain('adamw()')))" 2>&1 | grep -vE "^\[New Thread|^\[Thread" | tail -40
