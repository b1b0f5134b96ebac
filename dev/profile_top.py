"""Top functions of a cProfile run by own time, in microseconds per step (pstats prints seconds
with 3 decimals, too coarse for a step of a few hundred microseconds)."""
import pstats


def print_top(profile, steps, n=10, title=""):
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[:n]
    print(f"--- {title}: own / cumulative us per step (cProfile, {steps} steps)")
    for (file, line, fn), (_, calls, own, cum, _) in rows:
        where = "/".join(file.split("/")[-2:])
        print(f"  {own / steps * 1e6:9.1f} {cum / steps * 1e6:9.1f}  {calls / steps:7.1f} calls  {where}:{line}({fn})")
