"""A/B of the backward kernels of several source trees, interleaved in one process tree.

    python benchmarks/ab_backward.py TREE [TREE ...] [--passes 2] [--ns 4096 16384] [--ds 128 64]

Each TREE is a directory holding a version's ``fp4_inductor`` and ``benchmarks`` (for
example ``git archive REV fp4_inductor benchmarks pyproject.toml | tar -x -C DIR``).  Every
pass runs ``explore_backward.py --kernel-only`` once per tree, in tree order, each in its
own process with that tree first on the path, so that differences between trees are not
differences between machines or clock states.  Prints, per shape, each tree's
``backward_kernel`` ms and its kernels' ms (min and max over the passes), and writes
ab_backward.json into --out-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def run_tree(tree, ns, ds, out_dir):
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "explore_backward.py"), "--kernel-only",
           "--ns", *map(str, ns), "--ds", *map(str, ds), "--out-dir", out_dir]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)))
    with open(os.path.join(out_dir, "explore_backward_kernels.json")) as f:
        return json.load(f)["timings"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--ds", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--out-dir", default=C.RESULTS)
    args = ap.parse_args()
    runs = {tree: [] for tree in args.trees}
    with tempfile.TemporaryDirectory() as scratch:
        for p in range(args.passes):
            for i, tree in enumerate(args.trees):
                runs[tree].append(run_tree(tree, args.ns, args.ds, os.path.join(scratch, f"{p}-{i}")))
    print(f"\nbackward_kernel ms (min-max over {args.passes} passes), then each kernel's")
    for d in args.ds:
        for n in args.ns:
            print(f"D={d} N={n}")
            for tree, timings in runs.items():
                rows = [t for run in timings for t in run if t["d"] == d and t["n"] == n]
                ms = [r["ms"] for r in rows]
                kernels = {k: min(r["per_kernel_ms"][k] for r in rows) for k in rows[0]["per_kernel_ms"]
                           if k.startswith("_")}
                print(f"  {tree:28s} {min(ms):7.3f}-{max(ms):7.3f}  "
                      + ", ".join(f"{k} {v:.3f}" for k, v in kernels.items()))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "ab_backward.json"), "w") as f:
        json.dump({"env": C.environment(), "trees": args.trees, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
