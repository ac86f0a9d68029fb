"""calibrate() on the CPU: its grid, the table it builds, where it is stored and how it is
validated, the order in which auto looks for a cost model (calibrated > shipped >
analytic), its command lines, the analytic model's fit to every shipped table, and a run
end to end with the GPU's name and the timing stubbed (here only)."""

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fp4_inductor
from fp4_inductor import analytic, calibration, cost_tables, policy
from fp4_inductor.calibration import Item
from fp4_inductor.config import Options
from test_policy import H200_PROPS, TABLE, _site

GPU = "Test GPU"


@pytest.fixture
def world(monkeypatch, tmp_path):
    """A Hopper on the CPU named GPU, with TABLE shipped for it and an empty cache."""
    monkeypatch.setenv("FP4ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(policy, "kernels_run_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(**{**H200_PROPS, "name": GPU}))
    monkeypatch.setattr(policy, "table_for", lambda gpu: policy.CostTable.from_json(json.dumps(TABLE)))
    monkeypatch.setattr(calibration, "_gpu", lambda: (GPU, {"name": GPU, "sms": 132}))
    return tmp_path


def _rates(item, name):
    """Synthetic TFLOP/s: fp8 well past BF16 at d128 (where TABLE says BF16 at 512 keys)."""
    return {"fp8": 900.0, "fp8-kernel": 1000.0, "bf16:cudnn": 500.0, "bf16:flash": 450.0,
            "fp8+bf16bwd:cudnn": 700.0, "bf16:dense-mask": 200.0}.get(name)


def _stub_measure(item, names, rep_ms):
    out = {}
    for name in names:
        rate = _rates(item, name)
        out[name] = ({"status": "ok", "ms": item.table_flops() / (rate * 1e9), "seconds": 0.1} if rate
                     else {"status": "not installed: FlashAttention-4 (flash_attn.cute)"})
    return out


def test_plan_measures_each_rows_range_first():
    items = calibration.plan()
    assert len(items) == len(set(items)) == 104
    first = [i for i, item in enumerate(items) if item.n in (2048, 8192) and item.mask != "window"][0]
    coarse = items[:first]
    assert {item.n for item in coarse} == {1024, 4096, 16384, 8192}  # 8192: the window rows' shortest
    assert all(item.n in (2048, 8192) for item in items[first:] if item.mask != "window")
    rows = {(i.kind, i.d, i.causal, i.mask) for i in items}
    assert rows == {(i.kind, i.d, i.causal, i.mask) for i in coarse}  # every row in the first pass
    assert [i.kind for i in coarse] == sorted((i.kind for i in coarse), key=calibration.KINDS.index)
    windows = [i.n for i in items if i.mask == "window"]
    assert sorted(windows) == [8192, 8192, 16384, 16384]
    assert calibration.plan(head_dims=(64,), lengths=(512,), kinds=("fwd",)) == [
        Item("fwd", 64, False, 512), Item("fwd", 64, True, 512)]


@pytest.mark.parametrize("item, mask", [
    (Item("fwd", 128, True, 4096), "causal"),
    (Item("train", 64, False, 2048), "none"),
    (Item("masked_fwd", 128, True, 8192, "left"), "causal+padding"),
    (Item("masked_fwd", 64, False, 1024, "right"), "padding"),
    (Item("masked_train", 128, True, 4096, "right"), "causal+padding"),
    (Item("masked_fwd", 128, True, 16384, "window"), "window 4096"),
])
def test_items_key_and_count_as_the_policy_does(item, mask):
    b, h = item.batch_heads()
    assert b * item.n == 16384 and h * item.d == 2048
    shape = policy.SiteShape(b, h, h, item.n, item.n, item.d, item.causal, item.training, mask=mask)
    assert item.table_key() == shape.table_key()
    if item.kind != "masked_fwd":
        assert item.table_flops() == pytest.approx(shape.flops())
    else:  # the structure's pairs, counted exactly (explore_masked_sites.py's "table" FLOPs)
        visible = policy.visible_fraction(item.n, item.n, 0, 4096 if item.mask == "window" else 0) \
            if item.causal else 1.0
        assert item.table_flops() == pytest.approx(4.0 * item.d * b * h * item.n ** 2 * visible)


def test_methods_name_the_bf16_backends_asked_for():
    assert calibration.methods(Item("fwd", 64, False, 1024)) == ("fp8", "fp8-kernel", "bf16:cudnn", "bf16:flash")
    train = calibration.methods(Item("train", 64, True, 1024), bf16=("fa4",))
    assert train == ("fp8", "fp8+bf16bwd:fa4", "fp8+bf16bwd:cudnn", "bf16:fa4")
    assert calibration.methods(Item("masked_train", 64, True, 1024, "left")) == ("fp8", "bf16:dense-mask")


def _row(item, method, tflops, status="ok"):
    return {**dataclasses.asdict(item), "key": item.table_key(), "method": method, "status": status,
            "tflops": tflops}


def test_table_takes_the_fastest_bf16_and_the_slower_padding_side():
    right, left = Item("masked_fwd", 128, True, 4096, "right"), Item("masked_fwd", 128, True, 4096, "left")
    fwd = Item("fwd", 64, False, 2048)
    rows = [_row(fwd, "bf16:cudnn", 400.04), _row(fwd, "bf16:flash", 300.0), _row(fwd, "fp8", 500.0),
            _row(fwd, "bf16:fa4", 9000.0, status="not installed: FlashAttention-4"),
            _row(right, "fp8", 700.0), _row(left, "fp8", 650.0),
            _row(right, "bf16:dense-mask", 150.0), _row(left, "bf16:dense-mask", 160.0),
            {**_row(fwd, "fp8-kernel", None), "status": "error: RuntimeError: boom"}]
    table = calibration.build_table(rows, GPU, "synthetic")
    padded = "d128/causal/fwd/causal+padding"
    assert table["tflops"] == {"bf16": {"d64/full/fwd": {"2048": 400.0}, padded: {"4096": 160.0}},
                               "fp8": {"d64/full/fwd": {"2048": 500.0}, padded: {"4096": 650.0}}}
    shipped = json.loads((cost_tables.SHIPPED / "nvidia_h200.json").read_text())
    assert set(table) == set(shipped)  # the shipped tables' format exactly
    shape = policy.SiteShape(8, 32, 32, 2048, 2048, 64, False, False)
    assert policy.CostTable.from_doc(table).rate("fp8", shape) == 500


def test_calibrated_table_round_trips_keyed_by_versions(world):
    table = calibration.build_table([_row(Item("fwd", 128, False, 4096), "fp8", 800.0)], GPU, "synthetic")
    path = cost_tables.save_calibrated(table)
    assert path == world / "cache" / "cost-table-test_gpu.json"
    doc = json.loads(path.read_text())  # JSON, never a pickle
    assert doc["environment"] == cost_tables.versions(GPU) and doc["table"] == table
    assert set(doc["environment"]) == {"gpu", "torch", "triton", "cuda", "fp4_inductor"}
    assert cost_tables.load_calibrated(GPU) == table
    assert cost_tables.load_calibrated("Other GPU") is None  # no file: silently none


@pytest.mark.parametrize("corrupt, why", [
    (lambda doc: {**doc, "environment": {**doc["environment"], "torch": "0.0.1"}}, "measured under"),
    (lambda doc: {**doc, "environment": {**doc["environment"], "fp4_inductor": "0.0.0"}}, "measured under"),
    (lambda doc: {**doc, "schema": 99}, "unknown schema"),
    (lambda doc: {**doc, "table": {**doc["table"], "gpu": "Other GPU"}}, "measured on Other GPU"),
    (lambda doc: {**doc, "table": {**doc["table"], "tflops": {"fp8": {"d128/full/fwd": {"4096": -1}}}}},
     "not a cost table"),
    (lambda doc: {**doc, "table": {**doc["table"], "tflops": {"fp8": {"../../x": {"4096": 1.0}}}}},
     "not a cost table"),
    (lambda doc: {**doc, "table": {**doc["table"], "launch_us": True}}, "not a cost table"),
])
def test_a_stale_or_malformed_calibration_is_ignored_with_a_warning(world, corrupt, why):
    table = calibration.build_table([_row(Item("fwd", 128, False, 4096), "fp8", 800.0)], GPU, "synthetic")
    path = cost_tables.save_calibrated(table)
    path.write_text(json.dumps(corrupt(json.loads(path.read_text()))))
    with pytest.warns(RuntimeWarning, match=why):
        assert cost_tables.load_calibrated(GPU) is None
    with pytest.warns(RuntimeWarning, match=why):
        assert policy.calibrated_table(GPU) is None


def test_unreadable_files_are_ignored(world):
    path = cost_tables.calibrated_path(GPU)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x80not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert cost_tables.load_calibrated(GPU) is None
    path.unlink()
    target = world / "elsewhere.json"
    target.write_text("{}")
    path.symlink_to(target)
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert cost_tables.load_calibrated(GPU) is None


def test_lookup_order_calibrated_then_shipped_then_analytic(world, monkeypatch):
    device = torch.device("cuda", 0)
    site = _site(n=4096)
    shipped = policy.decide(site, Options())
    assert policy.cost_model(device).label == "cost model" and shipped.reason.startswith("cost model")
    rates = {"fp8": {"d128/full/fwd": {"4096": 400.0}}, "bf16": {"d128/full/fwd": {"4096": 600.0}}}
    cost_tables.save_calibrated({"gpu": GPU, "launch_us": 15.0, "source": "calibrated here", "tflops": rates})
    model = policy.cost_model(device)
    assert model.calibrated and model.source == "calibrated here"
    calibrated = policy.decide(site, Options())
    assert shipped.path == "fp8" and calibrated.path == "bf16"  # the calibration changed the decision
    assert calibrated.reason.startswith("calibrated cost model")
    monkeypatch.setattr(cost_tables, "versions", lambda gpu: {"gpu": gpu, "torch": "a later one"})
    with pytest.warns(RuntimeWarning, match="measured under"):
        assert policy.cost_model(device).label == "cost model"  # stale: the shipped table again
    monkeypatch.setattr(policy, "table_for", lambda gpu: None)
    assert policy.cost_model(device).label.startswith("analytic model")  # (the same stale file: warned once)


def test_calibrate_end_to_end_with_stubbed_timing(world, monkeypatch):
    monkeypatch.setattr(calibration, "_measure", _stub_measure)
    site = _site(b=32, h=16, hkv=16, n=512)  # TABLE: fp8 slower than BF16 at 512 keys
    assert policy.decide(site, Options()).path == "bf16"
    out, raw = world / "tables", world / "raw"

    result = fp4_inductor.calibrate(head_dims=(128,), lengths=(512, 4096), budget_s=60, save=True, out_dir=out,
                                    raw_out=raw, progress=False)

    assert isinstance(result, fp4_inductor.Calibration) and result.gpu == GPU
    assert result.path == cost_tables.calibrated_path(GPU)
    assert (out / "test_gpu.json").read_text() == cost_tables.table_text(result.table)
    stored = cost_tables.load_calibrated(GPU)
    assert stored == result.table
    table = policy.CostTable.from_doc(stored)
    shape = policy.SiteShape(32, 16, 16, 512, 512, 128, False, False)
    assert table.rate("fp8", shape) == pytest.approx(900.0) and table.rate("bf16", shape) == pytest.approx(500.0)
    assert table.rate("fp8+bf16bwd:cudnn", dataclasses.replace(shape, training=True)) == pytest.approx(700.0)
    assert "fp8+bf16bwd:fa4" not in stored["tflops"]  # recorded as not installed, kept out
    decision = policy.decide(site, Options())
    assert decision.path == "fp8" and decision.reason.startswith("calibrated cost model")
    doc = json.loads((raw / "calibration-test_gpu.json").read_text())
    assert doc["versions"] == cost_tables.versions(GPU) and doc["table"] == result.table
    assert {m["status"] for m in doc["measurements"]} == {"ok", "not installed: FlashAttention-4 (flash_attn.cute)"}
    assert calibration.table_from_raw(raw / "calibration-test_gpu.json") == result.table
    assert "calibrated Test GPU" in str(result)


def test_the_budget_keeps_each_rows_range(world, monkeypatch):
    clock = iter(range(10**6))
    monkeypatch.setattr(calibration, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    monkeypatch.setattr(calibration, "_measure", _stub_measure)
    result = fp4_inductor.calibrate(kinds=("fwd",), budget_s=5.5, save=False, progress=False)
    measured = [m for m in result.measurements if m["status"] == "ok"]
    skipped = [m for m in result.measurements if m["status"] == calibration.SKIPPED]
    assert measured and skipped and result.path is None
    assert {m["n"] for m in measured} <= {1024, 4096, 16384}  # the coarse pass comes first


def test_calibrate_refuses_without_a_hopper_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only error")
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        fp4_inductor.calibrate()
    with pytest.raises(ValueError, match="kinds"):
        calibration._check_options((128,), (1024,), ("decode",), ("cudnn",), 1.0, 1.0)


def test_runs_record_why_instead_of_raising():
    if torch.cuda.is_available():
        pytest.skip("checks the failure path: without a GPU every method records its error")
    from fp4_inductor import calibration_runs

    names = calibration.methods(Item("train", 64, True, 1024))
    results = calibration_runs.run_item(Item("train", 64, True, 1024), names, None)
    assert set(results) == set(names) and all(r["status"].startswith("error: ") for r in results.values())


def test_command_line(world, monkeypatch, capsys):
    args = calibration.parser().parse_args(["--budget", "30", "--head-dims", "64", "--bf16", "cudnn", "fa4",
                                            "--raw-out", "r", "--no-save", "--warm-workers", "0"])
    assert (args.budget, args.head_dims, args.bf16, args.raw_out, args.save, args.warm_workers) == \
        (30.0, [64], ["cudnn", "fa4"], Path("r"), False, 0)
    assert args.kinds == list(calibration.KINDS) and args.lengths == list(calibration.LENGTHS)
    with pytest.raises(SystemExit):
        calibration.parser().parse_args(["--bf16", "math"])
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        table = calibration.build_table([_row(Item("fwd", 128, False, 4096), "fp8", 800.0)], GPU, "stub")
        return calibration.Calibration(GPU, table, None, [], 1.0)

    monkeypatch.setattr(calibration, "calibrate", fake)
    assert calibration.main(["--budget", "45", "--kinds", "fwd", "train", "--quiet"]) == 0
    assert seen["budget_s"] == 45 and seen["kinds"] == ("fwd", "train") and seen["save"] and not seen["progress"]
    script = Path(__file__).parents[1] / "benchmarks" / "cost_table.py"
    spec = importlib.util.spec_from_file_location("cost_table", script)
    cost_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost_table)
    refits = []
    monkeypatch.setattr(cost_table, "fit", lambda out=None: refits.append(out) or {})
    assert cost_table.main(["--out", str(world / "o"), "--raw-out", str(world / "r")]) == 0
    assert seen["out_dir"] == world / "o" and seen["raw_out"] == world / "r" and seen["budget_s"] == 180
    assert not seen["save"] and refits == [world / "o"]  # a shipped table stays out of the cache


# Issue 62's target: the analytic model within 10 % of each shipped table at every grid
# point.  Missed at these points (path, row family, N: the bound the fit meets, on rates and
# on speedups over BF16), where the two tables disagree by more than any difference of the
# two GPUs can explain: the H100 and the H200 have the same SMs and clocks and the H200 more
# bandwidth, yet the H200's table (benchmark scripts of 2026-12-02) has the fp8 path at
# 0.5-0.8x the H100's (calibrate(), 2026-12-06) at short lengths, with its own fp8-kernel
# rows equal to the H100's (its N=1024 forward rows put 2-5x more time on the quantization
# than its longer ones, which move the same bytes); and its key padding (another random
# draw) has the padded forward rows at 0.81-0.86x the H100's at long lengths.  The margins
# cover these errors (checked below); a refreshed H200 table (calibrate() on an H200) is
# what would bring them under 10 %.
MISSES = {
    ("fp8", "causal/fwd", 1024): 0.42,
    ("fp8", "full/fwd", 1024): 0.21,
    ("fp8", "causal/fwd/causal+padding", 1024): 0.40,
    ("fp8", "causal/fwd/causal+padding", 2048): 0.24,
    ("fp8", "causal/fwd/causal+padding", 16384): 0.12,
    ("fp8", "full/fwd/padding", 1024): 0.17,
    ("fp8", "full/fwd/padding", 2048): 0.15,
    ("fp8", "full/fwd/padding", 8192): 0.13,
    ("fp8", "full/fwd/padding", 16384): 0.15,
    ("fp8", "causal/train", 2048): 0.37,
    ("fp8", "full/train", 2048): 0.14,
    ("fp8", "causal/train/causal+padding", 1024): 0.50,
    ("fp8", "causal/train/causal+padding", 2048): 0.40,
    ("fp8", "causal/train/causal+padding", 4096): 0.37,
    ("fp8", "full/train/padding", 1024): 0.37,
    ("fp8", "full/train/padding", 2048): 0.24,
}


def test_analytic_fit_is_current_and_within_its_bounds_of_every_shipped_table():
    """The shipped constants are a fit to the shipped tables (refit with
    ``benchmarks/cost_table.py --fit`` when a table changes); they reproduce each table
    within 10 % at every grid point, rates and speedups over BF16, but at ``MISSES``, and
    the model's margin at every point covers its error there."""
    tables = analytic.shipped_tables()
    constants = analytic.load_fit()
    assert constants["tables"] == sorted(t["gpu"] for t in tables) and len(tables) >= 2
    assert analytic.fit(tables) == constants
    worst = {}
    for table in tables:
        predicted = analytic.synthesize(analytic.Hardware.known(table["gpu"]), constants)["tflops"]
        for row, rate in analytic._rows(table):
            error = abs(predicted[row.path][row.key][str(row.n)] / rate - 1)
            point = (row.path, row.family, row.n)
            worst[point] = max(worst.get(point, 0.0), error)
        for (path, key, n), error in analytic.fit_errors(constants, table)["points"].items():
            point = (path, analytic.Row(path, key, n).family, n)
            worst[point] = max(worst.get(point, 0.0), error)
            assert error <= analytic.margin(constants, path, key, n) + 1e-4, (table["gpu"], path, key, n, error)
    over = {point: round(error, 3) for point, error in worst.items() if error > MISSES.get(point, 0.10)}
    assert not over, over
    assert set(MISSES) <= set(worst)
    assert constants["speedup_error"] <= max(MISSES.values())


def test_analytic_model_follows_the_hardware():
    """An H100 PCIe gets the H100's efficiencies at its own SMs and clock; an H20, a quarter
    of the tensor-core rate per SM and the same exp unit, gets BF16 far slower and FP8's
    advantage larger (its tensor cores, not the exp unit, bound BF16)."""
    constants = analytic.load_fit()
    h200 = analytic.synthesize(analytic.Hardware.known("NVIDIA H200"), constants)["tflops"]
    pcie = analytic.synthesize(analytic.Hardware.of("NVIDIA H100 PCIe", 114, 1_755_000, 1_593_000, 5120),
                               constants)["tflops"]
    h20 = analytic.synthesize(analytic.Hardware.of("NVIDIA H20", 78, 1_980_000, 2_619_000, 6144), constants)["tflops"]
    key, n = "d128/full/fwd", "16384"
    assert h20["bf16"][key][n] < pcie["bf16"][key][n] < h200["bf16"][key][n]
    assert h20["bf16"][key][n] == pytest.approx(h200["bf16"][key][n] * 78 / 132 / 4, rel=0.01)
    speedup = {name: t["fp8"][key][n] / t["bf16"][key][n] for name, t in (("h200", h200), ("h20", h20))}
    assert speedup["h20"] > speedup["h200"] > 1


def test_gpu_tables_and_fit_are_valid_json_tables():
    for path in cost_tables.SHIPPED.glob("*.json"):
        if not path.name.startswith("_"):
            cost_tables.check_table(json.loads(path.read_text()))
    assert os.path.basename(analytic.FIT_PATH).startswith("_")
