"""Why q8 states use power-4 companding (issue 34): Adam with its two moments block-quantized (blocks
of 256, the block's largest |x| as scale) under code maps x = scale * sign(q) * (|q|/127)^k for
k = 1 (linear) .. 4, rounded to nearest or stochastically, against float32 moments, on a noisy
quadratic whose gradient scales span 6 orders of magnitude across blocks and 2 within a block (as
rows of an embedding or layers of different sizes). numpy only; a few seconds.

    python3 bench/q8_codec_sim.py

Prints, per map, the mean and 99th percentile of |p - p_float32| / mean |p_float32| after 400 steps
and the largest |update| seen (float32 moments: about 1.4; an 8-bit map that sets small second
moments to 0 while the first moment is not gives m / eps and blows up).
"""
import numpy as np  # noqa: E402
rng = np.random.default_rng(0); N = 256 * 64
scale = np.repeat(10 ** rng.uniform(-6, 0, N // 256), 256) * 10 ** rng.uniform(-2, 0, N)
target = rng.normal(size=N)
R = np.random.default_rng(7)
def quant(x, k, sr):
    xb = x.reshape(-1, 256); s = np.abs(xb).max(1, keepdims=True); s[s == 0] = 1; t = xb / s
    c = np.abs(t) ** (1 / k) * 127                      # companded, in code units
    lo = np.floor(c); hi = np.minimum(lo + 1, 127)
    dlo = (lo / 127) ** k; dhi = (hi / 127) ** k; a = np.abs(t)
    if sr:
        pr = np.where(dhi > dlo, (a - dlo) / np.where(dhi > dlo, dhi - dlo, 1), 0)
        q = np.where(R.random(a.shape) < pr, dhi, dlo)
    else:
        q = (np.round(c) / 127) ** k
    return (np.sign(t) * q * s).reshape(-1)
def run(k, sr, steps=400, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    p = np.zeros(N); m = np.zeros(N); v = np.zeros(N); maxu = 0; r = np.random.default_rng(1)
    for t in range(1, steps + 1):
        g = scale * (p - target) + scale * r.normal(size=N) * 0.5
        m = b1 * m + (1 - b1) * g; v = b2 * v + (1 - b2) * g * g
        if k: m = quant(m, k, sr); v = quant(v, k, sr)
        u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps); maxu = max(maxu, np.abs(u).max()); p -= lr * u
    return p, maxu
import warnings; warnings.filterwarnings('ignore')
ref, mu = run(0, False); print(f"fp32 max|u| {mu:.3g}")
for k in [1, 2, 3, 4]:
    for sr in [False, True]:
        p, mu = run(k, sr); err = np.abs(p - ref) / np.abs(ref).mean()
        print(f"pow{k} sr={sr!s:5} mean rel dev {err.mean():.4f} p99 {np.quantile(err,0.99):.3g} max|u| {mu:.3g}")
