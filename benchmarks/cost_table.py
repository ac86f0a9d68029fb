"""Make a shipped cost table: run the package's calibration (``fp4_inductor.calibrate()``,
``fp4_inductor/calibration.py``) on this GPU, write the table as ``<out>/<gpu>.json``, the
name the policy looks up in ``fp4_inductor/tables/``, and refit the analytic model to the
shipped tables with it (``fp4_inductor/analytic.py``), writing ``<out>/_analytic_fit.json``.

    python benchmarks/cost_table.py [--out fp4_inductor/tables] [--raw-out DIR] [calibrate's options]
    python benchmarks/cost_table.py --fit    # no GPU: refit to fp4_inductor/tables/*.json

A table written elsewhere than ``fp4_inductor/tables`` ships once copied there with its
``_analytic_fit.json``.  Unlike ``calibrate()`` on a user's machine, it stores nothing in
the cache directory and measures for longer (``--budget``, default 180 s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp4_inductor import analytic, calibration  # noqa: E402

TABLES = analytic.SHIPPED
BUDGET_S = 180.0


def fit(out: Path = TABLES) -> dict | None:
    """Refit to the shipped tables and those in ``out`` (which replace them GPU by GPU)."""
    try:
        constants = analytic.refit(TABLES, out, path=Path(out) / analytic.FIT_PATH.name)
    except (KeyError, ValueError) as err:  # a GPU without known properties, no fp8 rows
        print(f"analytic model not refitted: {err}", file=sys.stderr)
        return None
    print(f"{Path(out) / analytic.FIT_PATH.name}: analytic model fitted to {', '.join(constants['tables'])}; "
          f"largest error: rates {constants['rate_error']:.1%}, speedups {constants['speedup_error']:.1%}")
    return constants


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--fit", action="store_true", help="only refit the analytic model to the shipped tables")
    ours, rest = ap.parse_known_args(argv)
    if ours.fit:
        return 0 if fit() is not None else 1
    status = calibration.main(rest, out=TABLES, budget=BUDGET_S, save=False)
    if status == 0:
        out = calibration.parser(out=TABLES).parse_args(rest).out
        fit(out)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
