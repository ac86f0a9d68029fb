"""``fp4_inductor.calibrate()``: measure on the GPU at hand what the cost model needs, and
keep it as this GPU's cost table, which ``auto`` then reads before the shipped one.

    python -m fp4_inductor.calibrate [--budget 120] [--out DIR] [--raw-out DIR] [...]

What is measured (``plan``, ``methods``), on FlashAttention-3's grid (B N = 16k tokens,
H D = 2048), BF16 Gaussian inputs, head dims 64 and 128, causal and not:

- ``fwd``: the fp8 path with its quantization pass (``fp8``) and its kernels alone
  (``fp8-kernel``), against BF16 SDPA;
- ``train``, forward + backward: the fp8 path compiled (as a model compiled with the
  backend runs it), the hybrid path (fp8 forward, BF16 backward) with each BF16 backward
  it takes (FlashAttention-4 where installed, cuDNN), against BF16 SDPA;
- ``masked_fwd``: key padding (right and left when causal, right when not) and a
  4096-key window (causal, from 8192 keys), the fp8 path against SDPA on the dense boolean
  mask a model hands it (what such a site falls back to); ``masked_train`` the same with
  key padding, forward + backward.

BF16 is the fastest of the backends ``bf16`` names (``BF16_BACKENDS``): by default torch
SDPA's cuDNN and flash backends, which is what a site the policy leaves in BF16 runs (with
FlashAttention-4 activated into SDPA, its flash backend is FA4); ``"fa4"`` adds
FlashAttention-4 called directly.  Rates are TFLOP/s in the FLOPs the policy counts for
the site (``Item.table_flops``), each a median of ``triton.testing.do_bench``.

Lengths run coarse first (each row's shortest, middle and longest), then the rest, until
``budget_s`` is spent.  What the budget leaves out and what cannot run (a backend missing,
an error) is recorded with its reason and kept out of the table.  The table is stored in
the cache directory keyed by the GPU and the software versions (``cost_tables``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from . import cost_tables
from ._version import __version__

KINDS = ("fwd", "train", "masked_fwd", "masked_train")
HEAD_DIMS = (128, 64)
LENGTHS = (1024, 2048, 4096, 8192, 16384)
BF16_BACKENDS = ("cudnn", "flash")
BF16_CHOICES = ("cudnn", "flash", "fa4")
WINDOW = 4096  # the window rows' (analytic.WINDOW)
TOKENS, WIDTH = 16384, 2048  # FlashAttention-3's grid: B N tokens, H D elements per token
# Fixed cost of the low-precision path's extra kernels (quantization of Q, K, V and K's
# mean) at shapes too small to fill the GPU: about five launches of ~3 us.
LAUNCH_US = 15.0
# (causal, mask) per kind; mask "right"/"left": key padding at that end of each sequence.
CASES = {
    "fwd": ((False, "none"), (True, "none")),
    "train": ((False, "none"), (True, "none")),
    "masked_fwd": ((True, "right"), (True, "left"), (False, "right"), (True, "window")),
    "masked_train": ((True, "right"), (True, "left"), (False, "right")),
}
SKIPPED = "skipped: time budget spent"


@dataclasses.dataclass(frozen=True)
class Item:
    """One shape of the grid and what runs at it (every method of ``methods``)."""

    kind: str
    d: int
    causal: bool
    n: int
    mask: str = "none"

    @property
    def training(self) -> bool:
        return self.kind in ("train", "masked_train")

    @property
    def window(self) -> int:
        return WINDOW if self.mask == "window" else 0

    def batch_heads(self) -> tuple[int, int]:
        return max(TOKENS // self.n, 1), max(WIDTH // self.d, 1)

    def table_key(self) -> str:
        """The cost table's key (``policy.SiteShape.table_key``)."""
        key = f"d{self.d}/{'causal' if self.causal else 'full'}/{'train' if self.training else 'fwd'}"
        if self.mask == "window":
            return f"{key}/window"
        if self.mask in ("right", "left"):
            return f"{key}/{'causal+padding' if self.causal else 'padding'}"
        return key

    def table_flops(self) -> float:
        """The FLOPs the policy counts for such a site: those of its causal structure (not of
        the padding, which it cannot see), 3.5x in training (as the benchmarks counted)."""
        b, h = self.batch_heads()
        n = self.n
        if self.kind == "masked_fwd":  # the structure's visible pairs, counted exactly
            if self.mask == "window":
                w = min(WINDOW, n)
                pairs = w * (w + 1) / 2 + (n - w) * w
            else:
                pairs = n * (n + 1) / 2 if self.causal else n * n
            return 4.0 * self.d * b * h * pairs
        flops = 4.0 * b * h * n * n * self.d / (2 if self.causal else 1)
        return flops * (3.5 if self.training else 1.0)

    def label(self) -> str:
        mask = "" if self.mask == "none" else f" {self.mask}"
        return f"{self.kind} d{self.d} {'causal' if self.causal else 'full'}{mask} N={self.n}"


def plan(head_dims=HEAD_DIMS, lengths=LENGTHS, kinds=KINDS) -> list[Item]:
    """The grid in the order it is measured: first every row at its shortest, middle and
    longest length (so that a cut-short run still has each row's range), then the rest;
    within each, by kind, head dim, causality, mask and length."""
    ordered = []
    for kind in kinds:
        for d in head_dims:
            for causal, mask in CASES[kind]:
                ns = sorted({n for n in lengths if mask != "window" or n >= 2 * WINDOW})
                coarse = {ns[0], ns[len(ns) // 2], ns[-1]} if ns else set()
                for n in ns:
                    item = Item(kind, d, causal, n, mask)
                    ordered.append(((n not in coarse), KINDS.index(kind), item))
    ordered.sort(key=lambda t: (t[0], t[1]))  # stable: the loops' order within a pass and kind
    return [item for _, _, item in ordered]


def methods(item: Item, bf16=BF16_BACKENDS) -> tuple[str, ...]:
    """What runs at an item: the low-precision paths, then BF16 by each backend."""
    if item.kind.startswith("masked"):
        return ("fp8", "bf16:dense-mask")
    backends = tuple(f"bf16:{b}" for b in bf16)
    if item.kind == "fwd":
        return ("fp8", "fp8-kernel", *backends)
    return ("fp8", "fp8+bf16bwd:fa4", "fp8+bf16bwd:cudnn", *backends)


def build_table(rows, gpu: str, source: str) -> dict:
    """The cost table of measured rows (``status`` "ok"): per key and length, BF16 the
    fastest backend (and padding side), a low-precision path its slower padding side, so
    that the policy never credits the better case."""
    rates: dict = {}
    for row in rows:
        if row.get("status") != "ok" or not _positive(row.get("tflops")):
            continue
        method = row["method"]
        path, pick = ("bf16", max) if method.startswith("bf16:") else (method, min)
        points = rates.setdefault(path, {}).setdefault(row["key"], {})
        n, rate = str(row["n"]), round(row["tflops"], 1)
        points[n] = pick(points[n], rate) if n in points else rate
    return {"gpu": gpu, "launch_us": LAUNCH_US, "source": source, "tflops": rates}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclasses.dataclass
class Calibration:
    """What ``calibrate()`` measured: the GPU, the cost table (the format of the shipped
    tables), where it was stored (None when not saved), every measurement (one dict per
    shape and method: ``status`` "ok" with ``ms`` and ``tflops``, else why not), and the
    run's wall time in seconds."""

    gpu: str
    table: dict
    path: Path | None
    measurements: list
    seconds: float

    def __str__(self) -> str:
        ok = sum(m["status"] == "ok" for m in self.measurements)
        skipped = sum(m["status"] == SKIPPED for m in self.measurements)
        where = f"stored in {self.path}" if self.path else "not stored"
        return (f"calibrated {self.gpu} in {self.seconds:.0f} s: {ok} of {len(self.measurements)} measurements "
                f"({skipped} left out by the time budget, {len(self.measurements) - ok - skipped} could not run); "
                f"{where}")


def _gpu() -> tuple[str, dict]:
    """This GPU's name and properties, or RuntimeError saying why calibration cannot run."""
    if not torch.cuda.is_available():
        raise RuntimeError("fp4_inductor.calibrate() measures on a CUDA GPU; none is available")
    from .kernels import kernels_run_on

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if (props.major, props.minor) != (9, 0):
        raise RuntimeError(f"fp4_inductor.calibrate() measures the sm_90 (Hopper) kernels; {props.name} is "
                           f"sm_{props.major}{props.minor}")
    if not kernels_run_on(torch.device("cuda", index)):
        raise RuntimeError("fp4_inductor.calibrate(): the kernels are off (FP4ATTN_KERNELS=0)")
    names = {"sms": "multi_processor_count", "clock_khz": "clock_rate", "memory_clock_khz": "memory_clock_rate",
             "bus_bits": "memory_bus_width", "memory_bytes": "total_memory"}
    info = {key: getattr(props, attr, None) for key, attr in names.items()}
    return torch.cuda.get_device_name(index), {"name": props.name, "capability": f"{props.major}.{props.minor}",
                                               **info}


def _measure(item: Item, names: tuple[str, ...], rep_ms: float) -> dict:
    """{method: {"status": ..., "ms": ...}} for one item, timed on the GPU."""
    from . import calibration_runs

    return calibration_runs.run_item(item, names, functools.partial(calibration_runs.median_ms, rep_ms=rep_ms))


class _Progress:
    """tqdm's bar where tqdm is installed, else a line per tenth of the run."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="calibrate", unit="shape", file=sys.stderr)
            except ImportError:
                pass

    def update(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.done * 10 // self.total != (self.done - 1) * 10 // self.total):
            print(f"calibrate: {self.done}/{self.total} ({label})", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def calibrate(*, budget_s: float = 120.0, head_dims=HEAD_DIMS, lengths=LENGTHS, kinds=KINDS,
              bf16=BF16_BACKENDS, rep_ms: float = 30.0, warm_workers: int = 0, save: bool = True,
              out_dir: str | Path | None = None, raw_out: str | Path | None = None,
              progress: bool = True) -> Calibration:
    """Measure this GPU's cost table (see the module's docstring for what) in about
    ``budget_s`` seconds of measurement, store it in the cache directory for ``auto`` to
    read before the shipped table (``save``), and return what was measured.

    ``head_dims``, ``lengths``, ``kinds``: the grid (``plan``); ``bf16``: the BF16 backends
    whose fastest is BF16's rate (``BF16_CHOICES``); ``rep_ms``: ``do_bench``'s repetition
    time per measurement.  ``warm_workers``: compile every shape's kernels first in that many
    spawned processes (Triton's and Inductor's caches on disk are shared), within half the
    budget; the command line uses it, a script that calls ``calibrate()`` must guard its
    top level with ``if __name__ == "__main__":`` to use it.  ``out_dir``: also write the
    table there as ``<gpu>.json`` (the shipped tables' name); ``raw_out``: write every
    measurement there as ``calibration-<gpu>.json``.  Resets Dynamo's caches (the
    compiled training steps are compiled afresh per shape)."""
    _check_options(head_dims, lengths, kinds, bf16, budget_s, rep_ms)
    gpu, properties = _gpu()
    started = time.monotonic()
    deadline = started + budget_s
    items = plan(head_dims, lengths, kinds)
    if warm_workers > 0:
        from . import calibration_runs

        calibration_runs.warm_up([(item, methods(item, bf16)) for item in items], warm_workers,
                                 started + budget_s / 2)
    bar = _Progress(len(items), progress)
    rows = []
    try:
        for item in items:
            names = methods(item, bf16)
            if time.monotonic() >= deadline:
                results = {name: {"status": SKIPPED} for name in names}
            else:
                results = _measure(item, names, rep_ms)
            b, h = item.batch_heads()
            for name in names:
                row = {**dataclasses.asdict(item), "b": b, "h": h, "key": item.table_key(), "method": name,
                       **results.get(name, {"status": "error: not run"})}
                if row["status"] == "ok" and _positive(row.get("ms")):
                    row["tflops"] = item.table_flops() / row["ms"] * 1e-9
                rows.append(row)
            bar.update(item.label())
    finally:
        bar.close()
    seconds = time.monotonic() - started
    env = cost_tables.versions(gpu)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ok = sum(row["status"] == "ok" for row in rows)
    source = (f"calibrate() {date}: torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']}, fp4_inductor "
              f"{__version__}; bf16 {'/'.join(bf16)}; {ok}/{len(rows)} measurements in {seconds:.0f} s")
    table = build_table(rows, gpu, source)
    path = cost_tables.save_calibrated(table) if save and table["tflops"] else None
    if out_dir is not None and table["tflops"]:
        cost_tables.write_table(table, Path(out_dir))
    if raw_out is not None:
        raw = {"versions": env, "date": date, "properties": properties, "budget_s": budget_s, "rep_ms": rep_ms,
               "bf16": list(bf16), "grid": f"B*N={TOKENS}, H*D={WIDTH}", "seconds": seconds, "measurements": rows,
               "table": table}
        raw_path = Path(raw_out) / f"calibration-{cost_tables.gpu_slug(gpu)}.json"
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(raw, indent=1) + "\n")
    return Calibration(gpu, table, path, rows, seconds)


def _check_options(head_dims, lengths, kinds, bf16, budget_s, rep_ms) -> None:
    from .formats import supported_head_dim

    if not head_dims or any(not isinstance(d, int) or not supported_head_dim(d) for d in head_dims):
        raise ValueError(f"head_dims must be supported head dims (formats.supported_head_dim), got {head_dims!r}")
    if not lengths or any(not isinstance(n, int) or not 16 <= n <= 1 << 20 for n in lengths):
        raise ValueError(f"lengths must be integers from 16 to 2**20, got {lengths!r}")
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"kinds must be among {KINDS}, got {kinds!r}")
    if not bf16 or set(bf16) - set(BF16_CHOICES):
        raise ValueError(f"bf16 must be among {BF16_CHOICES}, got {bf16!r}")
    if not budget_s > 0 or not rep_ms > 0:
        raise ValueError(f"budget_s and rep_ms must be positive, got {budget_s!r}, {rep_ms!r}")


def table_from_raw(path: str | Path) -> dict:
    """The cost table of a raw measurement file (``raw_out``), rebuilt as ``calibrate()``
    built it: no GPU needed."""
    raw = json.loads(Path(path).read_text())
    return build_table(raw["measurements"], raw["versions"]["gpu"], raw["table"]["source"])


def parser(**defaults) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fp4_inductor.calibrate",
                                 description="Measure this GPU's cost table for fp4_inductor's auto policy.")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of measurement (default 120)")
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--bf16", nargs="+", choices=BF16_CHOICES, default=list(BF16_BACKENDS),
                    help="BF16 backends whose fastest is BF16's rate (default: torch SDPA's cuDNN and flash)")
    ap.add_argument("--rep-ms", type=float, default=30.0, help="do_bench repetition time per measurement")
    ap.add_argument("--warm-workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                    help="processes that compile every shape's kernels first (0: none)")
    ap.add_argument("--no-save", dest="save", action="store_false", help="do not store the table in the cache")
    ap.add_argument("--out", type=Path, default=None, help="also write the table as OUT/<gpu>.json")
    ap.add_argument("--raw-out", type=Path, default=None,
                    help="write every measurement as RAW_OUT/calibration-<gpu>.json")
    ap.add_argument("--from-raw", type=Path, default=None,
                    help="no measuring: rebuild the table from a raw measurement file (with --out, write it)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.set_defaults(**defaults)
    return ap


def main(argv=None, **defaults) -> int:
    args = parser(**defaults).parse_args(argv)
    if args.from_raw is not None:
        table = table_from_raw(args.from_raw)
        print(cost_tables.write_table(table, args.out) if args.out else cost_tables.table_text(table), end="\n")
        return 0
    try:
        result = calibrate(budget_s=args.budget, head_dims=tuple(args.head_dims), lengths=tuple(args.lengths),
                           kinds=tuple(args.kinds), bf16=tuple(args.bf16), rep_ms=args.rep_ms,
                           warm_workers=args.warm_workers, save=args.save, out_dir=args.out, raw_out=args.raw_out,
                           progress=not args.quiet)
    except (RuntimeError, ValueError) as err:
        print(f"calibrate: {err}", file=sys.stderr)
        return 1
    print(result)
    failed = sorted({f"{m['method']}: {m['status']}" for m in result.measurements
                     if m["status"] not in ("ok", SKIPPED)})
    for line in failed[:20]:
        print(f"  not measured: {line}"[:300])
    if args.out is not None and result.table["tflops"]:
        print(f"wrote {cost_tables.shipped_path(result.gpu).name} to {args.out}")
    return 0 if result.table["tflops"] else 1
