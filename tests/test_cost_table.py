"""policy_grid.py --rescore judges a timed grid with the table shipped now.  Synthetic rows
with random rates; no GPU needed.  (How a table is made from measurements, and
benchmarks/cost_table.py's command line: test_calibrate.py.)"""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from fp4_inductor import policy

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rescore_judges_the_timed_rows_with_the_shipped_table(tmp_path, monkeypatch, fresh_seed):
    rng = random.Random(fresh_seed)
    bf16_rate = rng.uniform(100, 900)
    table = policy.CostTable(gpu="Test GPU", launch_us=0.0, source="rebuilt",
                             rates={"fp8": {"d128/full/train": [(1024, bf16_rate * 1.5)],
                                            "d128/full/train/padding": [(1024, bf16_rate * 0.5)]},
                                    "bf16": {"d128/full/train": [(1024, bf16_rate)],
                                             "d128/full/train/padding": [(1024, bf16_rate)]}})
    monkeypatch.setattr(policy, "table_for", lambda gpu: table if gpu == "Test GPU" else None)
    bf16_ms, fp8_slower, fp8_faster = rng.uniform(1, 5), rng.uniform(1.05, 2), rng.uniform(0.5, 0.95)
    shape = dict(b=1, h=8, n=4096, causal=False, training=True)
    rows = [  # timed under an older table that picked BF16 everywhere
        dict(shape, d=128, bf16_ms=bf16_ms, fp8_ms=bf16_ms * fp8_faster, pick="bf16", regret=1 / fp8_faster - 1),
        dict(shape, d=64, bf16_ms=bf16_ms, fp8_ms=bf16_ms * fp8_slower, pick="bf16", regret=0.0),
        # key-padded training: priced by the padded rates, which say BF16 here
        dict(shape, d=128, padded=True, bf16_ms=bf16_ms, fp8_ms=bf16_ms * fp8_faster, pick="fp8", regret=0.0),
    ]
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"env": {"device": "Test GPU", "date": "2026-01-01T00:00:00"}, "summary": {},
                                "rows": rows}))

    doc = _script("policy_grid").rescore(grid)

    rescored = {row["d"]: row for row in doc["rows"] if not row.get("padded")}
    padded = doc["rows"][-1]
    assert padded["pick"] == "bf16" and padded["predicted_speedup"] == pytest.approx(0.5)
    assert padded["regret"] == pytest.approx(1 / fp8_faster - 1)
    assert rescored[128]["pick"] == "fp8" and rescored[128]["regret"] == 0
    assert rescored[128]["predicted_speedup"] == pytest.approx(1.5)
    assert rescored[64]["pick"] == "bf16" and "no rate" in rescored[64]["reason"]
    assert rescored[64]["bf16_ms"] == bf16_ms and rescored[64]["fp8_ms"] == bf16_ms * fp8_slower  # timings kept
    assert doc["summary"]["right"] == 2 and doc["summary"]["worst_regret"] == padded["regret"]
    assert doc["env"]["table"] == "rebuilt" and doc["env"]["date"] == "2026-01-01T00:00:00" and "rescored" in doc["env"]
