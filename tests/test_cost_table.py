"""benchmarks/cost_table.py turns benchmark JSONs into the policy's table: which rows it
takes for each path, and that the policy then decides what those rows imply.  Synthetic
rows with random rates; no GPU needed."""

import dataclasses
import importlib.util
import json
import random
from pathlib import Path

import pytest

from fp4_inductor import policy

COST_TABLE = Path(__file__).resolve().parent.parent / "benchmarks" / "cost_table.py"


def _cost_table():
    spec = importlib.util.spec_from_file_location("cost_table", COST_TABLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc(rows, date):
    return {"env": {"device": "Test GPU", "date": date, "torch": "test"}, "results": rows}


def _row(method, d, n, causal, tflops, **extra):
    return dict(method=method, d=d, n=n, causal=causal, status="ok", tflops=tflops, **extra)


def test_table_takes_the_charged_fp8_rows_and_the_faster_bf16_backend(tmp_path, monkeypatch, fresh_seed):
    rng = random.Random(fresh_seed)
    quant, bare, cudnn, train_cudnn = (rng.uniform(100, 900) for _ in range(4))
    flash = cudnn * rng.uniform(0.5, 0.9)  # the slower backend comes last: the faster one must stay
    train_ours = train_cudnn * rng.uniform(1.15, 1.5)  # past the policy's margin
    forward = [
        _row("ours-direct+quant", 128, 4096, False, quant),
        _row("ours-direct", 128, 4096, False, bare + 1000),  # without quantization: not the path's cost
        _row("sdpa-cudnn-bf16", 128, 4096, False, cudnn),
        _row("sdpa-flash-bf16", 128, 4096, False, flash),
        _row("fa4-bf16", 128, 4096, False, 5000.0),  # not a fallback the user gets
        _row("cudnn-fp8", 128, 4096, False, 5000.0),
        dict(_row("sdpa-flash-bf16", 64, 4096, True, 5000.0), status="error: out of memory"),
    ]
    training = [
        _row("ours-direct-compiled", 128, 32768, True, train_ours, **{"pass": "fwd+bwd"}),
        _row("ours-direct-compiled", 128, 32768, True, 5000.0, **{"pass": "bwd"}),  # backward alone
        _row("sdpa-cudnn-bf16", 128, 32768, True, train_cudnn, **{"pass": "fwd+bwd"}),
        _row("ours-direct", 128, 32768, True, 5000.0, **{"pass": "fwd+bwd"}),  # eager: not what a compile runs
    ]
    fwd_path, train_path = tmp_path / "forward.json", tmp_path / "training.json"
    fwd_path.write_text(json.dumps(_doc(forward, "2026-01-01")))
    train_path.write_text(json.dumps(_doc(training, "2026-01-02")))
    out = tmp_path / "tables" / "test_gpu.json"
    monkeypatch.setattr(policy, "table_path", lambda gpu: out)

    _cost_table().main(str(fwd_path), str(train_path))

    doc = json.loads(out.read_text())
    assert doc["gpu"] == "Test GPU" and "2026-01-01" in doc["source"] and "2026-01-02" in doc["source"]
    assert doc["tflops"]["fp8"] == {"d128/full/fwd": {"4096": round(quant, 1)},
                                    "d128/causal/train": {"32768": round(train_ours, 1)}}
    assert doc["tflops"]["bf16"] == {"d128/full/fwd": {"4096": round(max(cudnn, flash), 1)},
                                     "d128/causal/train": {"32768": round(train_cudnn, 1)}}

    table = policy.CostTable.from_json(out.read_text())
    shape = policy.SiteShape(b=1, h=16, hkv=16, nq=32768, nk=32768, d=128, causal=True, training=True)
    flops = shape.flops()
    want = (flops / (round(train_cudnn, 1) * 1e12)) / (flops / (round(train_ours, 1) * 1e12)
                                                       + table.launch_us * 1e-6)
    assert table.speedup(shape, "fp8") == pytest.approx(want)
    assert policy.cost_model_decision(shape, "fp8", table, "Test GPU").path == "fp8"
    # Non-causal training was not measured: no rate, so BF16.
    full = policy.cost_model_decision(dataclasses.replace(shape, causal=False), "fp8", table, "Test GPU")
    assert full.path == "bf16" and "no rate" in full.reason
