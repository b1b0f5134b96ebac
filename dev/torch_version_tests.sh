#!/usr/bin/env bash
# The Python suite (or the tests given) against another torch than CI's newest, on the CPU here:
# the H200 has torch 2.11, and a Dynamo or FSDP2 behaviour that differs between versions shows up
# here without device time (this is how the torch.compile crash of run 4, 2026-12-02, was reproduced).
# Usage: dev/torch_version_tests.sh [torch version, default 2.11.0] [pytest args, default tests/python]
# Makes a venv in /work/venv-t<version> (torch from PyPI with its CUDA wheels, about 5 GB; runs on the
# CPU), and runs pytest there on the optfuse package installed in the main Python (scripts/test.sh or
# pip install . builds it), with this tree's Python sources laid over it.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.11.0}
shift || true
venv=/work/venv-t${version//./}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version" numpy pytest expecttest
fi
installed=$(python3 -c "import optfuse, os; print(os.path.dirname(optfuse.__file__))")
overlay=$(mktemp -d)
cp -r "$installed" "$overlay/optfuse"
cp -r python/optfuse/. "$overlay/optfuse/"  # this tree's Python over the installed extension
PYTHONPATH=$overlay "$venv/bin/python" -m pytest -q -p no:cacheprovider "${@:-tests/python}"
