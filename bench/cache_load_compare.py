#!/usr/bin/env python3
"""Runs bench/cache_load.cpp's binaries built against two (or more) liboptfuse.a, alternating, and
prints per chain the median first-construction time (wall and thread CPU) of each and the change.

    python3 bench/cache_load_compare.py --rounds 5 --procs 10 before=/tmp/cl_before after=/tmp/cl_after

Each binary gets its own warm cache directory (filled by one `cache_load 20` run, whose repeated
construction medians are printed too). A round runs `--procs` processes of `cache_load first` per
binary, binaries alternating within the round; the medians are over every process of every round.
The 1-minute load average is printed before and after each round: on a machine shared with other
work, compare the CPU-time columns first (wall time includes the time other processes had the core).
"""
import argparse
import os
import statistics
import subprocess
import tempfile

CHAINS = ["sgd", "adamw", "clip+adamw", "lamb", "adafactor"]


def load():
    return os.getloadavg()[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--procs", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=20, help="constructions per chain in the filling run")
    ap.add_argument("builds", nargs="+", help="name=path of a cache_load binary")
    a = ap.parse_args()
    builds = [b.split("=", 1) for b in a.builds]
    env = {}
    for name, path in builds:
        env[name] = dict(os.environ, OPTFUSE_CACHE_DIR=tempfile.mkdtemp(prefix="cache_load_" + name + "_"))
        out = subprocess.run([path, str(a.repeat)], env=env[name], check=True, capture_output=True, text=True).stdout
        print(f"# {name}: repeated constructions ({a.repeat} per chain, one process)\n" + out.rstrip())
    wall = {n: [[] for _ in CHAINS] for n, _ in builds}
    cpu = {n: [[] for _ in CHAINS] for n, _ in builds}
    loads = []
    for r in range(a.rounds):
        l0 = load()
        for _ in range(a.procs):
            for name, path in builds:
                out = subprocess.run([path, "first"], env=env[name], check=True, capture_output=True, text=True).stdout
                w, c = out.split("cpu:")
                for i, v in enumerate(w.replace("wall:", "").split()):
                    wall[name][i].append(float(v))
                for i, v in enumerate(c.split()):
                    cpu[name][i].append(float(v))
        loads.append((l0, load()))
        print(f"# round {r + 1}: load average (1 min) {l0:.2f} -> {loads[-1][1]:.2f}")
    base = builds[0][0]
    n = a.rounds * a.procs
    print(f"# first construction in a process, medians of {n} processes per build (us)")
    print("chain        " + "".join(f"{name + ' wall':>16}{name + ' cpu':>16}" for name, _ in builds))
    for i, chain in enumerate(CHAINS):
        row = f"{chain:<13}"
        for name, _ in builds:
            mw, mc = statistics.median(wall[name][i]), statistics.median(cpu[name][i])
            if name == base:
                row += f"{mw:16.1f}{mc:16.1f}"
            else:
                bw, bc = statistics.median(wall[base][i]), statistics.median(cpu[base][i])
                row += f"{mw:9.1f} ({(mw / bw - 1) * 100:+4.0f}%){mc:9.1f} ({(mc / bc - 1) * 100:+4.0f}%)"
        print(row)
    print(f"# load average (1 min) over the rounds: {min(min(x) for x in loads):.2f} to {max(max(x) for x in loads):.2f}")


if __name__ == "__main__":
    main()
