"""The cost model of a Hopper GPU that has neither a shipped nor a calibrated table: the
measured tables carried to it through its hardware.

Every rate of a table (a path, a row key, a length N of FlashAttention-3's grid:
B N = 16k tokens, H D = 2048) is a time, which the model splits in two:

- the kernels': the visible scores times the seconds per score of the row's bottleneck
  unit on the GPU, per pass (a forward, and in training a backward, each bound by the
  slowest of the tensor cores at the pass's precision, the exp unit and the issue slots:
  ``PASSES``), over an efficiency;
- the quantization's (low-precision rows with their quantization counted), a roofline of
  its own: the slower of its bytes over the memory bandwidth (times a factor: the
  bandwidth it reaches) and its elements' lane operations over the SMs' issue slots.  It
  moves the same tokens at every N, so its two constants are global.

``fit`` takes the quantization's two constants from the forward rows measured with and
without it (on every table at once, by a robust least squares of the log error), then the
efficiencies (per row and N) from every shipped table as geometric means over the tables:
with one table the model reproduces it; with several the spread between them is the fit's
error.  The model's margin is that error, per family of rows (a path, a key less its head
dim: ``causal/fwd``, ``full/train/padding``, ...) and length: the largest error on the
speedup over BF16 of the family's rows there on any table (``margins``), so that a decision
needs the predicted speedup to exceed 1 + the error the fit makes there.
``synthesize`` writes the table the model predicts for a GPU from its properties: SM count,
clock and memory bandwidth as CUDA reports them, the tensor-core rate per SM by model (an
H20 has a quarter of an H100's per SM and the same exp unit), 16 exp per SM per clock and
128 issued lane operations per SM per clock on sm_90.

    python benchmarks/cost_table.py --fit    # refit to tables/*.json: tables/_analytic_fit.json

(``benchmarks/cost_table.py`` refits after writing a table too.)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

from .cost_tables import SHIPPED, check_table, table_text

FIT_PATH = SHIPPED / "_analytic_fit.json"  # no GPU's slug starts with "_"
SCHEMA = 2
TOKENS, WIDTH = 16384, 2048  # the tables' grid: B N tokens, H D elements per token
WINDOW = 4096  # the window of the tables' "window" rows (calibration.WINDOW)
EXP_PER_CLOCK = 16  # MUFU.EX2 per SM per clock (sm_90)
ISSUE_PER_CLOCK = 128  # lane operations issued per SM per clock: 4 schedulers x 32 lanes
# Dense BF16 tensor-core FLOP per SM per clock; 8-bit (E4M3, INT8) runs at twice it.  From
# NVIDIA's peak figures: H100 SXM 989 TFLOP/s at 132 SMs x 1.83 GHz; H100 PCIe 756 at
# 114 x 1.62; the H20 148 at 78 x ~1.85, a quarter per SM.
BF16_FLOP_PER_CLOCK = 4096
BF16_FLOP_PER_CLOCK_BY_MODEL = {r"\bH20\b": 1024}
# Per score and pass: tensor-core FLOPs in units of the head dim, exp-unit operations,
# issued lane operations (nominal counts: the efficiencies absorb what they miss).  BF16
# softmax: one exp per score; Direct-P: none, 12 instructions (SASS count,
# docs/perf-notes/); the FP8 backward rebuilds P the same way and quantizes dS; fp4's P
# is a classifier.
PASSES = {
    "bf16": {"fwd": (4, 1, 4), "bwd": (10, 1, 8)},
    "fp8": {"fwd": (4, 0, 12), "bwd": (10, 0, 24)},
    "fp4": {"fwd": (4, 0, 30)},
}
# Bytes the quantization moves per element of Q (K and V as many, Q K V read in BF16, V
# twice, 8-bit codes written; in training dO read and quantized and O read for delta), and
# the elements it quantizes per element of Q (Q, K, V; in training dO too).
QUANT_BYTES = {"fwd": 11, "train": 16, "hybrid": 11}
QUANT_ELEMENTS = {"fwd": 3, "train": 4, "hybrid": 3}
# What CUDA reports for the GPUs with shipped tables (SM clock and memory clock in kHz,
# bus width in bits): the fit needs each table's hardware.  calibrate() records them.
KNOWN_GPUS = {
    "NVIDIA H200": dict(sms=132, clock_khz=1_980_000, memory_clock_khz=3_201_000, bus_bits=6144),
    "NVIDIA H100 80GB HBM3": dict(sms=132, clock_khz=1_980_000, memory_clock_khz=2_619_000, bus_bits=5120),
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    sms: int
    clock_hz: float
    bandwidth: float  # bytes/s
    bf16_flop: float  # dense BF16 tensor-core FLOP per SM per clock

    @classmethod
    def of(cls, name: str, sms: int, clock_khz: float, memory_clock_khz: float, bus_bits: int) -> "Hardware":
        flop = next((f for pattern, f in BF16_FLOP_PER_CLOCK_BY_MODEL.items() if re.search(pattern, name)),
                    BF16_FLOP_PER_CLOCK)
        return cls(name, int(sms), clock_khz * 1e3, 2 * memory_clock_khz * 1e3 * bus_bits / 8, flop)

    @classmethod
    def known(cls, name: str) -> "Hardware":
        if name not in KNOWN_GPUS:
            raise KeyError(f"no properties for {name!r}: add them to analytic.KNOWN_GPUS (calibrate()'s raw "
                           "JSON records them under 'properties')")
        return cls.of(name, **KNOWN_GPUS[name])

    def seconds_per_score(self, path: str, d: float, training: bool) -> float:
        """Each pass's slowest unit, summed over the row's passes."""
        low = path.split(":")[0].removesuffix("-kernel")
        fwd = "fp8" if low.startswith("fp8") else low
        passes = [(fwd, "fwd")] + ([("bf16" if "bf16bwd" in low else fwd, "bwd")] if training else [])
        clocks = 0.0
        for precision, name in passes:
            flop, exps, ops = PASSES[precision][name]
            rate = self.bf16_flop * (1 if precision == "bf16" else 2)
            clocks += max(flop * d / rate, exps / EXP_PER_CLOCK, ops / ISSUE_PER_CLOCK)
        return clocks / (self.sms * self.clock_hz)

    def issue_seconds(self, lane_operations: float) -> float:
        """The time the SMs' issue slots take for ``lane_operations``."""
        return lane_operations / (ISSUE_PER_CLOCK * self.sms * self.clock_hz)


@dataclasses.dataclass(frozen=True)
class Row:
    """One rate of a table: its path, key and length, and the grid's work there."""

    path: str
    key: str
    n: int

    @property
    def training(self) -> bool:
        return self.key.split("/")[2] == "train"

    @property
    def head_dims(self) -> tuple[int, int]:
        m = re.match(r"d(\d+)(?:v(\d+))?", self.key)
        return int(m.group(1)), int(m.group(2) or m.group(1))

    def scores(self) -> float:
        """Visible (query, key) pairs on the grid at N: all, half when causal, a window's."""
        d = self.head_dims[0]
        b, h, n = max(TOKENS // self.n, 1), WIDTH // d, self.n
        causal = self.key.split("/")[1] == "causal"
        if self.key.endswith("/window") and n > WINDOW:
            pairs = WINDOW * (WINDOW + 1) / 2 + (n - WINDOW) * WINDOW
        else:
            pairs = n * n / 2 if causal else n * n
        return b * h * pairs

    def flops(self) -> float:
        return 2.0 * sum(self.head_dims) * self.scores() * (3.5 if self.training else 1.0)

    @property
    def quantized(self) -> str | None:
        """What the row's quantization pass quantizes (a ``QUANT_BYTES`` kind), None where
        the row has none (BF16, the kernels alone)."""
        if self.path == "bf16" or self.path.endswith("-kernel"):
            return None
        return "hybrid" if "bf16bwd" in self.path else "train" if self.training else "fwd"

    def quant_bytes(self) -> float:
        return QUANT_BYTES[self.quantized] * TOKENS * WIDTH if self.quantized else 0.0

    def quant_elements(self) -> float:
        return QUANT_ELEMENTS[self.quantized] * TOKENS * WIDTH if self.quantized else 0.0

    @property
    def family(self) -> str:
        """The key less its head dims: the rows whose errors one margin covers."""
        return self.key.split("/", 1)[1]

    def seconds_per_score(self, hw: Hardware) -> float:
        return hw.seconds_per_score(self.path, sum(self.head_dims) / 2, self.training)


def _rows(table: dict):
    for path, by_key in table["tflops"].items():
        for key, points in by_key.items():
            for n, rate in points.items():
                yield Row(path, key, int(n)), float(rate)


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _quant_points(tables: list[dict], hardware: dict) -> list[tuple]:
    """Per forward row measured with and without its quantization: (seconds the
    quantization took, its byte floor, its lane-operation floor per op per element)."""
    points = []
    for t in tables:
        hw, rates = hardware[t["gpu"]], t["tflops"]
        for key, by_n in rates.get("fp8", {}).items():
            for n, rate in by_n.items():
                kernel = rates.get("fp8-kernel", {}).get(key, {}).get(n)
                row = Row("fp8", key, int(n))
                if kernel and kernel > rate:
                    seconds = row.flops() * (1 / rate - 1 / kernel) * 1e-12
                    points.append((seconds, row.quant_bytes() / hw.bandwidth, hw.issue_seconds(row.quant_elements())))
    return points


def _fit_quantization(points: list[tuple]) -> dict:
    """The quantization's roofline, ``max(bytes / bandwidth x over_floor, elements x
    ops_per_element / issue rate)``, by least squares of the log error with a soft-L1
    loss (a point off by 10 % weighs as in least squares, one off by 3x as a few of them:
    a table's outlier does not drag the others)."""
    def loss(factor, ops):
        return sum(math.log1p((math.log(max(factor * floor, ops * issue) / s) / 0.1) ** 2)
                   for s, floor, issue in points)

    best = min(((loss(f / 100, o), f / 100, o) for f in range(100, 301, 2) for o in range(0, 201, 2)))
    _, factor, ops = best
    fine = min((loss(f / 1000, o / 10), f / 1000, o / 10) for f in range(int(factor * 1000) - 20, int(factor * 1000) + 21)
               for o in range(max(int(ops * 10) - 20, 0), int(ops * 10) + 21))
    return {"over_floor": round(fine[1], 3), "ops_per_element": round(fine[2], 1)}


def fit(tables: list[dict]) -> dict:
    """The model's constants from measured tables (each with its GPU in ``KNOWN_GPUS``),
    with its error against each of them and the margins that cover it."""
    hardware = {t["gpu"]: Hardware.known(t["gpu"]) for t in tables}
    points = _quant_points(tables, hardware)
    if not points:
        raise ValueError("no table has fp8 rows with and without quantization: nothing to fit the quantization to")
    quant = _fit_quantization(points)
    efficiencies: dict = {}
    for t in tables:
        hw = hardware[t["gpu"]]
        for row, rate in _rows(t):
            seconds = row.flops() / (rate * 1e12)
            kernel = max(seconds - _quant_seconds(row, quant, hw), 0.1 * seconds)
            efficiency = row.scores() * row.seconds_per_score(hw) / kernel
            efficiencies.setdefault(row.path, {}).setdefault(row.key, {}).setdefault(str(row.n), []).append(efficiency)
    constants = {
        "schema": SCHEMA,
        "tables": sorted(hardware),
        "quantization": quant,
        "efficiency": {path: {key: {n: round(_geomean(e), 5) for n, e in points.items()}
                              for key, points in by_key.items()} for path, by_key in efficiencies.items()},
    }
    errors = {t["gpu"]: fit_errors(constants, t) for t in tables}
    constants["rate_error"] = round(max(e["rate"] for e in errors.values()), 4)
    constants["speedup_error"] = round(max(e["speedup"] for e in errors.values()), 4)
    constants["margins"] = _margins(tables, [e["points"] for e in errors.values()])
    return constants


def _margins(tables: list[dict], points: list[dict]) -> dict:
    """Per low-precision path, family and length, the largest speedup error there on any
    table.  Where only one table has the path's family at that length the fit reproduces it
    and has no error to show, so the margin is the widest of its neighbours': the same
    family and length on the paths measured on several tables, the same path and family at
    the nearest length measured on several."""
    seen: dict = {}  # (path, family, n) -> [tables measuring it, largest error]
    for t, errors in zip(tables, points):
        for (path, key, n), error in errors.items():
            entry = seen.setdefault((path, Row(path, key, n).family, n), [set(), 0.0])
            entry[0].add(t["gpu"])
            entry[1] = max(entry[1], error)
    shared = {k: e for k, (gpus, e) in seen.items() if len(gpus) > 1}
    margins: dict = {}
    for (path, family, n), (gpus, error) in sorted(seen.items()):
        if len(gpus) < 2:
            same_length = [e for (p, f, m), e in shared.items() if f == family and m == n]
            lengths = [m for (p, f, m) in shared if p == path and f == family]
            nearest = [shared[(path, family, min(lengths, key=lambda m: abs(math.log(m / n))))]] if lengths else []
            error = max([error] + same_length + nearest)
        margins.setdefault(path, {}).setdefault(family, {})[str(n)] = round(error, 4)
    return margins


def _quant_seconds(row: Row, quant: dict, hw: Hardware) -> float:
    if not row.quantized:
        return 0.0
    return max(row.quant_bytes() / hw.bandwidth * quant["over_floor"],
               hw.issue_seconds(row.quant_elements()) * quant["ops_per_element"])


def synthesize(hw: Hardware, constants: dict) -> dict:
    """The table the model predicts for ``hw``: every row and length the fit has."""
    quant = constants["quantization"]
    rates: dict = {}
    for path, by_key in constants["efficiency"].items():
        for key, points in by_key.items():
            for n, efficiency in points.items():
                row = Row(path, key, int(n))
                seconds = row.scores() * row.seconds_per_score(hw) / efficiency + _quant_seconds(row, quant, hw)
                rates.setdefault(path, {}).setdefault(key, {})[n] = round(row.flops() / seconds * 1e-12, 1)
    return {"gpu": hw.name, "launch_us": 15.0, "tflops": rates,
            "source": f"analytic: {hw.sms} SMs at {hw.clock_hz / 1e9:.2f} GHz, {hw.bandwidth / 1e12:.2f} TB/s, "
                      f"{hw.bf16_flop:.0f} BF16 FLOP/SM/clock; fitted to {', '.join(constants['tables'])}"}


def fit_errors(constants: dict, table: dict) -> dict:
    """The model's largest relative error against a measured table: over its rates, and
    over the low-precision paths' speedups over BF16 (what decisions read); ``points``:
    the speedup error per (path, key, N)."""
    predicted = synthesize(Hardware.known(table["gpu"]), constants)["tflops"]
    measured = table["tflops"]
    rate = max(abs(predicted[r.path][r.key][str(r.n)] / m - 1) for r, m in _rows(table))
    points = {}
    for r, m in _rows(table):
        bf16 = measured.get("bf16", {}).get(r.key, {}).get(str(r.n))
        if r.path == "bf16" or r.path.endswith("-kernel") or not bf16:
            continue
        ratio = (predicted[r.path][r.key][str(r.n)] / predicted["bf16"][r.key][str(r.n)]) / (m / bf16)
        points[(r.path, r.key, r.n)] = abs(ratio - 1)
    return {"rate": rate, "speedup": max(points.values(), default=0.0), "points": points}


def margin(constants: dict, path: str, key: str, n: float) -> float | None:
    """The fit's speedup error for ``path`` at a key and length (``margins``): the larger of
    the measured lengths either side of ``n`` (the nearest beyond the ends); None where the
    fit has no such row."""
    by_n = constants.get("margins", {}).get(path, {}).get(key.split("/", 1)[1] if "/" in key else key)
    if not by_n:
        return None
    lengths = sorted(int(m) for m in by_n)
    below = [m for m in lengths if m <= n][-1:] or lengths[:1]
    above = [m for m in lengths if m >= n][:1] or lengths[-1:]
    return max(by_n[str(below[0])], by_n[str(above[0])])


def shipped_tables(*directories: Path) -> list[dict]:
    """The measured tables in ``directories`` (default: the package's ``tables/``), one per
    GPU: a later directory's table replaces an earlier one's for the same GPU."""
    tables: dict[str, dict] = {}
    for directory in directories or (SHIPPED,):
        for path in sorted(Path(directory).glob("*.json")):
            if path.name.startswith(("_", "calibration-")):  # the fit's constants, raw measurements
                continue
            doc = json.loads(path.read_text())
            check_table(doc)
            tables[doc["gpu"]] = doc
    return [tables[gpu] for gpu in sorted(tables)]


@functools.cache
def load_fit() -> dict | None:
    """The fitted constants shipped with the package (None if absent)."""
    if not FIT_PATH.exists():
        return None
    constants = json.loads(FIT_PATH.read_text())
    return constants if constants.get("schema") == SCHEMA else None


def refit(*directories: Path, path: Path = FIT_PATH) -> dict:
    """Fit to the tables in ``directories`` (``shipped_tables``) and write the constants to
    ``path`` (by default where the package reads them)."""
    constants = fit(shipped_tables(*directories))
    path.write_text(table_text(constants))
    load_fit.cache_clear()
    return constants

