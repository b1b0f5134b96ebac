"""Host time per step() of two optfuse builds on the CPU, interleaved, for machines whose speed
drifts from minute to minute (a shared VM): each round runs bench/host_overhead_cpu.py once per build
in a child process (PYTHONPATH = the build's package folder), and the summary gives, per build and
workload, the minimum and the median over rounds of the per-round medians, and the ratio of the
minima (new / old).

  python3 bench/host_overhead_compare.py --old /tmp/oldsite --new python [--rounds 6]
      [--workloads gpt2-small,many-small] [--steps 300] [--env-new OPTFUSE_TORCH_READER=0] [--backward]

--old / --new: folders holding an importable `optfuse` (an install's --target folder, or python/ of
a tree whose extension is built there). --env-new K=V: an environment setting for the new build
only (e.g. to compare tensor readers within one build).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def one_round(path, workloads, steps, extra_env, extra_args):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path), **extra_env)
        subprocess.run([sys.executable, os.path.join(HERE, "host_overhead_cpu.py"), "--workloads", workloads,
                        "--steps", str(steps), "--json", f.name] + extra_args, check=True, env=env,
                       stdout=subprocess.DEVNULL)
        return {r["workload"]: r["host_us"] for r in json.load(open(f.name))["results"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workloads", default="gpt2-small,many-small")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--env-new", action="append", default=[])
    ap.add_argument("--backward", action="store_true", help="host_overhead_cpu.py --backward (autograd's gradients)")
    a = ap.parse_args()
    env_new = dict(kv.split("=", 1) for kv in a.env_new)
    runs = {"old": [], "new": []}
    for r in range(a.rounds):
        extra = ["--backward"] if a.backward else []
        runs["old"].append(one_round(a.old, a.workloads, a.steps, {}, extra))
        runs["new"].append(one_round(a.new, a.workloads, a.steps, env_new, extra))
        print(f"round {r + 1}: old {runs['old'][-1]}  new {runs['new'][-1]}", flush=True)
    for w in a.workloads.split(","):
        lo = {k: min(x[w] for x in v) for k, v in runs.items()}
        med = {k: statistics.median(x[w] for x in v) for k, v in runs.items()}
        print(f"{w:12s} old min {lo['old']:8.1f} median {med['old']:8.1f} | new min {lo['new']:8.1f} "
              f"median {med['new']:8.1f} | new/old {lo['new'] / lo['old']:.2f}x (minima), "
              f"{med['new'] / med['old']:.2f}x (medians)")


if __name__ == "__main__":
    main()
