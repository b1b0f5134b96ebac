"""bench/zero_vs_ddp.py runs (2 gloo ranks, a tiny workload) and its measured bytes per rank per step
equal the traffic model: DDP's all_reduce 2 (N-1)/N P g, ZeRO stage 1 that + (N-1) S p, stage 2
(N-1) S (g + p) + the gradient flags, exactly; the clip chain's partial-sum exchange within its
stated bound (and present). The bench checks this itself (nonzero exit); this test also checks the
JSON against the formulas, so a bench that stopped counting cannot pass. Bounded by a timeout."""
import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "zero_vs_ddp.py")
WORKLOAD = "gpt2-small@0.002"  # 248,796 float32 elements in 148 tensors: shard cuts inside the embedding


def test_bench_bytes_equal_the_model(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, BENCH, "--ranks", "2", "--workloads", WORKLOAD, "--steps", "2", "--warmup", "1",
           "--timeout", "90", "--pg-timeout", "60", "--json", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the bench did not finish within 120 s: {e}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every row matches" in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    assert res["failures"] == []
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"single optfuse", "single optfuse clip", "ddp optfuse", "ddp torch", "ddp optfuse clip",
                         "zero1", "zero1 clip", "zero2",
                         "zero2 clip"}
    n = 2
    P = rows["ddp optfuse"]["params"]
    T = rows["ddp optfuse"]["tensors"]
    S = rows["zero1"]["shard_elements"]
    assert P == 248796 and T == 148 and P // 2 <= S < P // 2 + 16384
    allreduce = Fraction(2 * (n - 1), n) * P * 4
    expect = {
        "single optfuse": 0, "single optfuse clip": 0,
        "ddp optfuse": allreduce, "ddp torch": allreduce, "ddp optfuse clip": allreduce,
        "zero1": allreduce + (n - 1) * S * 4,
        # one 25 MB bucket: its row is S; flags: which tensors have gradients, which buckets are sent again
        "zero2": (n - 1) * S * (4 + 4) + Fraction(2 * (n - 1), n) * 4 * (T + 1),
    }
    expect["zero1 clip"], expect["zero2 clip"] = expect["zero1"], expect["zero2"]
    for name, r in rows.items():
        assert r["reduce_scatter"], (name, "gloo in this torch has reduce_scatter_tensor; the model assumes it")
        assert r["model"] == float(expect[name]), (name, r["model"], float(expect[name]))
        for rank in next(p for p in res["per_rank"] if p["variant"] == name)["ranks"]:
            for step in rank["per_step"]:  # every step, warm-up included, every rank
                assert step["sent"] == step["recv"]
                if name.endswith("clip") and name.startswith("zero"):
                    # the exchange of per-chunk partial sums: a few bytes, and really there
                    assert 0 < step["sent"] - r["model"] <= r["tolerance"] < 4096, (name, step, r["tolerance"])
                else:
                    assert step["sent"] == r["model"], (name, step, r["model"])
        if name.startswith("zero"):  # half the optimizer state per rank (plus at most one chunk's)
            assert r["state_ratio"] <= 0.5 + 16384 * 8 / rows["ddp optfuse"]["state_bytes"], (name, r["state_ratio"])
        assert r["step_ms"] > 0
    assert res["machine"]["torch"] == torch.__version__
