"""Top functions of a cProfile run by own (or cumulative) time, in microseconds per step (pstats
prints seconds with 3 decimals, too coarse for a step of a few hundred microseconds)."""
import pstats


def print_top(profile, steps, n=10, title="", cumulative=False):
    column = 3 if cumulative else 2  # pstats' (calls, primitive calls, own, cumulative, callers)
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][column])[:n]
    print(f"--- {title}: own / cumulative us per step (cProfile, {steps} steps; sorted by "
          f"{'cumulative' if cumulative else 'own'} time)")
    for (file, line, fn), (_, calls, own, cum, _) in rows:
        where = "/".join(file.split("/")[-2:])
        print(f"  {own / steps * 1e6:9.1f} {cum / steps * 1e6:9.1f}  {calls / steps:7.1f} calls  {where}:{line}({fn})")
