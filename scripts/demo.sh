#!/usr/bin/env bash
# The main job: sets up and builds (their output goes to out/logs/), then takes one chain, clip by
# global norm + AdamW, through the optfuse program: explain (what it compiles to), check (the CPU
# kernel against the reference evaluator), bench (a step's time against the copy-bandwidth floor);
# then installs the Python package and trains a small GPT twice (torch.optim.AdamW vs
# optfuse.torch.AdamW), then six times with bfloat16 parameters (fp32, master weights, remainders,
# plain, stochastic rounding, Kahan), writing a plot of each. Each part starts with a "demo:" line
# saying what it shows; the last line names the plots.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
mkdir -p out/logs
# quietly LOG CMD...: runs CMD with its output in LOG; on failure prints the end of LOG and stops.
quietly() {
  local log=$1
  shift
  "$@" >"$log" 2>&1 || { echo "demo: '$*' failed; the end of $log:"; tail -n 40 "$log"; exit 1; }
}

echo "demo: setup and build (packages that are missing, then build/; on a fresh machine this takes minutes; logs in out/logs/)"
quietly out/logs/setup.log scripts/setup.sh
grep '^setup:' out/logs/setup.log || true
quietly out/logs/build.log scripts/build.sh

spec="chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))"
echo
echo "demo: 1/5 explain: what optfuse makes of the chain; below its plan (passes over memory, bytes per element, step schedule),"
echo "      in out/explain.txt the whole text with the IR after each pass (add --source for the generated C++)"
./build/optfuse explain "$spec" >out/explain.txt
sed -n '/^== plan/,$p' out/explain.txt
echo
echo "demo: 2/5 check: the same chain, compiled for the CPU, against the float64 reference evaluator, step by step"
./build/optfuse check "$spec" --steps 5
echo
echo "demo: 3/5 bench: one step of the same chain over 64M float32 elements on this CPU, against the copy-bandwidth floor"
./build/optfuse bench --chain "$spec" --workload cpu-default --backend cpu
echo
echo "demo: installing the Python package (log: out/logs/pip.log)"
quietly out/logs/pip.log python3 -m pip install -q --no-build-isolation .
echo
echo "demo: 4/5 train_gpt.py: a small GPT trained twice, torch.optim.AdamW vs optfuse.torch.AdamW: the same losses, and each optimizer's step time"
python3 examples/train_gpt.py --out out/train_gpt.png
echo
echo "demo: 5/5 train_gpt_bf16.py: the same GPT with bfloat16 weights: how much of fp32 training each precision option keeps"
python3 examples/train_gpt_bf16.py --out out/train_gpt_bf16.png
echo
echo "demo: plots: out/train_gpt.png out/train_gpt_bf16.png"
