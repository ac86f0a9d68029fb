"""benchmarks/bench_model.py end to end on tiny configs (CPU): every workload's code path,
the JSON it writes and its plot.  Timings on a CPU mean nothing and are not checked."""

import json
import os
import subprocess
import sys

# What the benchmark's process needs, which the test extra installs: missing, a failure here.
import diffusers  # noqa: F401
import matplotlib  # noqa: F401
import tqdm  # noqa: F401
import transformers  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_model_tiny(tmp_path):
    out = tmp_path / "model.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_model.py", "--tiny", "--reps", "1", "--seqs", "32",
         "--workloads", "prefill", "train", "wan", "--backends", "inductor", "fp4attn-auto", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["environment"]["date"] and doc["config"]["tiny"]
    rows = doc["rows"]
    assert {r["workload"] for r in rows} == {"prefill", "train", "wan"}
    assert {r["point"] for r in rows if r["workload"] == "prefill"} == {"S=32 mask"}
    assert {r["point"] for r in rows if r["workload"] == "train"} == {"S=64 ckpt"}
    for r in rows:
        assert set(r["backends"]) == {"inductor", "fp4attn-auto"}
        for b in r["backends"].values():
            assert "error" not in b, b
            assert b["median_s"] > 0 and b["tokens_per_s"] > 0 and b["vs_inductor"] > 0 and b["compile_s"] > 0
        assert isinstance(r["auto_picks"], list) and r["auto_picks"]
        assert all(p["path"] == "bf16" and "no low-precision kernel" in p["reason"] for p in r["auto_picks"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "wrote" in done.stdout
