#!/usr/bin/env bash
# The main job: sets up and builds, explains the default chain, checks the CPU backend against the
# reference evaluator, benchmarks a step on the default CPU workload, then installs the Python
# package and trains a small GPT twice (torch.optim.AdamW vs optfuse.torch.AdamW), then six times
# with bfloat16 parameters (fp32, master weights, remainders, plain, stochastic rounding, Kahan),
# writing a plot of each.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
scripts/setup.sh
scripts/build.sh
spec="chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))"
./build/optfuse explain "$spec"
./build/optfuse check "$spec"
./build/optfuse bench --workload cpu-default --backend cpu
python3 -m pip install -q --no-build-isolation .
mkdir -p out
python3 examples/train_gpt.py --out out/train_gpt.png
python3 examples/train_gpt_bf16.py --out out/train_gpt_bf16.png
echo "demo: wrote out/train_gpt.png and out/train_gpt_bf16.png"
