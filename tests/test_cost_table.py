"""benchmarks/cost_table.py turns benchmark JSONs into the policy's table: which rows it
takes for each path, and that the policy then decides what those rows imply; and
policy_grid.py --rescore judges a timed grid with the table shipped now.  Synthetic rows
with random rates; no GPU needed."""

import dataclasses
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
        _row("ours-direct", 128, 4096, False, bare + 1000),  # the kernel alone: the quantization's part apart
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
    full_cudnn = rng.uniform(100, 900)
    full_ours = full_cudnn * rng.uniform(0.7, 1.05)  # short of the margin
    training_full = [  # bench_attention.py --training --non-causal
        _row("ours-direct-compiled", 128, 32768, False, full_ours, **{"pass": "fwd+bwd"}),
        _row("sdpa-cudnn-bf16", 128, 32768, False, full_cudnn, **{"pass": "fwd+bwd"}),
    ]
    paths = [tmp_path / f"{name}.json" for name in ("forward", "training", "training_full")]
    for path, rows, date in zip(paths, (forward, training, training_full), ("2026-01-01", "2026-01-02", "2026-01-03")):
        path.write_text(json.dumps(_doc(rows, date)))
    out = tmp_path / "tables" / "test_gpu.json"
    monkeypatch.setattr(policy, "table_path", lambda gpu: out)

    _script("cost_table").main(*map(str, paths))

    doc = json.loads(out.read_text())
    assert doc["gpu"] == "Test GPU" and all(f"2026-01-0{i}" in doc["source"] for i in (1, 2, 3))
    assert doc["tflops"]["fp8"] == {"d128/full/fwd": {"4096": round(quant, 1)},
                                    "d128/causal/train": {"32768": round(train_ours, 1)},
                                    "d128/full/train": {"32768": round(full_ours, 1)}}
    assert doc["tflops"]["bf16"] == {"d128/full/fwd": {"4096": round(max(cudnn, flash), 1)},
                                     "d128/causal/train": {"32768": round(train_cudnn, 1)},
                                     "d128/full/train": {"32768": round(full_cudnn, 1)}}

    assert doc["tflops"]["fp8-kernel"] == {"d128/full/fwd": {"4096": round(bare + 1000, 1)}}

    table = policy.CostTable.from_json(out.read_text())
    # Inference: the charged rate for a K/V head per query head; GQA quantizes K and V
    # once per shared head (here 4), so the quantization's part shrinks to half.
    mha = policy.SiteShape(b=4, h=16, hkv=16, nq=4096, nk=4096, d=128, causal=False, training=False)
    gqa = dataclasses.replace(mha, hkv=4)
    t_bf16, t_kernel, t_charged = (mha.flops() / (round(r, 1) * 1e12) for r in (max(cudnn, flash), bare + 1000, quant))
    launch = table.launch_us * 1e-6
    assert table.speedup(mha, "fp8") == pytest.approx(t_bf16 / (t_charged + launch))
    assert gqa.quantized_share() == pytest.approx(0.5)
    assert table.speedup(gqa, "fp8") == pytest.approx(t_bf16 / (t_kernel + 0.5 * (t_charged - t_kernel) + launch))
    shape = policy.SiteShape(b=1, h=16, hkv=16, nq=32768, nk=32768, d=128, causal=True, training=True)
    flops = shape.flops()
    want = (flops / (round(train_cudnn, 1) * 1e12)) / (flops / (round(train_ours, 1) * 1e12)
                                                       + table.launch_us * 1e-6)
    assert table.speedup(shape, "fp8") == pytest.approx(want)
    assert policy.cost_model_decision(shape, "fp8", table, "Test GPU").path == "fp8"
    # Non-causal training from its own run: measured short of the margin, so BF16 with a ratio.
    full = policy.cost_model_decision(dataclasses.replace(shape, causal=False), "fp8", table, "Test GPU")
    assert full.path == "bf16" and "no rate" not in full.reason
    # A head dim whose training was not measured: no rate, so BF16.
    d64 = policy.cost_model_decision(dataclasses.replace(shape, d=64), "fp8", table, "Test GPU")
    assert d64.path == "bf16" and "no rate" in d64.reason


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


def _table_with(tmp_path, monkeypatch, **masked):
    """cost_table.main over a one-row forward JSON and ``masked`` (its ``masked`` or
    ``masked_training`` files): the table it writes, as text."""
    forward = tmp_path / "forward.json"
    forward.write_text(json.dumps(_doc([_row("ours-direct+quant", 128, 4096, False, 800.0),
                                        _row("sdpa-cudnn-bf16", 128, 4096, False, 600.0)], "2026-01-01")))
    out = tmp_path / "tables" / "test_gpu.json"
    monkeypatch.setattr(policy, "table_path", lambda gpu: out)
    _script("cost_table").main(str(forward), **masked)
    return out.read_text()


def _masked_row(d, n, causal, mask, kind, ours, sdpa):
    return {"d": d, "n": n, "causal": causal, "mask": mask, "mask_kind": kind,
            "ours_with_quant_table_tflops": ours, "sdpa_bf16_dense_mask_table_tflops": sdpa,
            "gluon_table_tflops": 5000.0}  # the kernel alone: not the path's cost


def test_masked_sites_get_rates_by_mask_kind(tmp_path, monkeypatch, fresh_seed):
    """``--masked``: explore_masked_sites.py's rows keyed by the site's mask kind, the
    slower padding side for low precision and the faster BF16 row, which the policy then
    finds for a key-padded site; a mask kind never measured keeps BF16."""
    rng = random.Random(fresh_seed)
    right, left, sdpa_a, sdpa_b, full, window = (rng.uniform(100, 900) for _ in range(6))
    masked = tmp_path / "masked.json"
    env = {"device": "Test GPU", "date": "2026-01-04", "torch": "test"}
    masked.write_text(json.dumps({"environment": env, "rows": [
        _masked_row(128, 8192, True, "right", "causal+padding", right, sdpa_a),
        _masked_row(128, 8192, True, "left", "causal+padding", left, sdpa_b),
        _masked_row(128, 8192, False, "right", "padding", full, sdpa_a),
        _masked_row(128, 16384, True, "window", "window 4096", window, sdpa_b),
    ]}))
    text = _table_with(tmp_path, monkeypatch, masked=(str(masked),))

    doc = json.loads(text)
    assert "2026-01-04" in doc["source"]
    assert doc["tflops"]["fp8"]["d128/causal/fwd/causal+padding"] == {"8192": round(min(right, left), 1)}
    assert doc["tflops"]["bf16"]["d128/causal/fwd/causal+padding"] == {"8192": round(max(sdpa_a, sdpa_b), 1)}
    assert doc["tflops"]["fp8"]["d128/full/fwd/padding"] == {"8192": round(full, 1)}
    assert doc["tflops"]["fp8"]["d128/causal/fwd/window"] == {"16384": round(window, 1)}

    table = policy.CostTable.from_json(text)
    shape = policy.SiteShape(b=2, h=16, hkv=16, nq=8192, nk=8192, d=128, causal=True, training=False,
                             mask="causal+padding")
    flops = shape.flops()
    want = (flops / (round(max(sdpa_a, sdpa_b), 1) * 1e12)) / (flops / (round(min(right, left), 1) * 1e12)
                                                               + table.launch_us * 1e-6)
    assert table.speedup(shape, "fp8") == pytest.approx(want)
    offset = policy.cost_model_decision(dataclasses.replace(shape, mask="causal+offset+padding"), "fp8", table,
                                        "Test GPU")
    assert offset.path == "bf16" and "no rate" in offset.reason
    shorter = policy.cost_model_decision(dataclasses.replace(shape, nq=4096, nk=4096), "fp8", table, "Test GPU")
    assert shorter.path == "bf16" and "no rate" in shorter.reason  # masked keys: never below the shortest measured


def test_padded_training_gets_rates_by_mask_kind(tmp_path, monkeypatch, fresh_seed):
    """``--masked-training``: explore_padded_training.py's compiled rows keyed as training
    sites with their mask kind, the shipped (Gluon) variant the low-precision rate, which a
    key-padded training site then finds; an eager run is refused."""
    rng = random.Random(fresh_seed)
    # Ours at least twice SDPA's rate: the key-padded training site must then take fp8.
    right, left, sdpa_a, sdpa_b = rng.uniform(500, 900), rng.uniform(500, 900), rng.uniform(100, 250), \
        rng.uniform(100, 250)

    def row(side, ours, sdpa):
        return {"d": 64, "n": 4096, "causal": True, "mask": side, "mask_kind": "causal+padding",
                "gluon_key_bias_table_tflops": ours, "sdpa_bf16_dense_mask_table_tflops": sdpa,
                "skipping_table_tflops": 5000.0}  # not what ships

    padded = tmp_path / "padded.json"
    env = {"device": "Test GPU", "date": "2026-01-05", "torch": "test"}
    padded.write_text(json.dumps({"environment": env, "compiled": True,
                                  "rows": [row("right", right, sdpa_a), row("left", left, sdpa_b)]}))
    text = _table_with(tmp_path, monkeypatch, masked_training=(str(padded),))

    doc = json.loads(text)
    assert "2026-01-05" in doc["source"]
    assert doc["tflops"]["fp8"]["d64/causal/train/causal+padding"] == {"4096": round(min(right, left), 1)}
    assert doc["tflops"]["bf16"]["d64/causal/train/causal+padding"] == {"4096": round(max(sdpa_a, sdpa_b), 1)}
    table = policy.CostTable.from_json(text)
    shape = policy.SiteShape(b=4, h=32, hkv=8, nq=4096, nk=4096, d=64, causal=True, training=True,
                             mask="causal+padding")
    decision = policy.cost_model_decision(shape, "fp8", table, "Test GPU")
    assert decision.path == "fp8" and decision.predicted_speedup >= policy.MIN_SPEEDUP, decision
    assert policy.cost_model_decision(dataclasses.replace(shape, training=False), "fp8", table,
                                      "Test GPU").path == "bf16"  # the forward's key was not measured

    padded.write_text(json.dumps({"environment": env, "compiled": False, "rows": [row("right", right, sdpa_a)]}))
    with pytest.raises(SystemExit, match="eager"):
        _table_with(tmp_path, monkeypatch, masked_training=(str(padded),))
