"""A/B of the attention kernels of several source trees, interleaved in one process tree.

    python benchmarks/ab_kernels.py TREE [TREE ...] [--forward] [--passes 2] [--ns 4096 16384] [--ds 128 64]

Each TREE is a directory holding a version's ``fp4_inductor`` and ``benchmarks`` (for
example ``git archive REV fp4_inductor benchmarks pyproject.toml | tar -x -C DIR``).  Every
pass runs ``explore_backward.py --kernel-only`` (``--forward``: ``explore_forward.py
--kernel-only``) once per tree, in tree order, each in its own process with that tree
first on the path, so that differences between trees are not differences between
machines or clock states.  Prints, per shape, each tree's ms (min and max over the passes)
and its kernels' ms, and writes ab_backward.json (ab_forward.json) into --out-dir (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402


def run_tree(tree, script, ns, ds, out_dir):
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "lab", f"explore_{script}.py"), "--kernel-only",
           "--ns", *map(str, ns), "--ds", *map(str, ds), "--out-dir", out_dir]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)))
    with open(os.path.join(out_dir, f"explore_{script}_kernels.json")) as f:
        return json.load(f)["timings"]


def _shape(row):
    causal = f" causal={int(row['causal'])}" if "causal" in row else ""
    return f"D={row['d']} N={row['n']}{causal}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--forward", action="store_true", help="the forward kernels instead of the backward's")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--ds", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    script = "forward" if args.forward else "backward"
    runs = {tree: [] for tree in args.trees}
    with tempfile.TemporaryDirectory() as scratch:
        for p in range(args.passes):
            for i, tree in enumerate(args.trees):
                runs[tree].append(run_tree(tree, script, args.ns, args.ds, os.path.join(scratch, f"{p}-{i}")))
    print(f"\n{script} ms (min-max over {args.passes} passes), then each kernel's")
    shapes = list(dict.fromkeys(_shape(row) for row in runs[args.trees[0]][0]))
    for shape in shapes:
        print(shape)
        for tree, timings in runs.items():
            rows = [t for run in timings for t in run if _shape(t) == shape]
            ms = [r["ms"] for r in rows]
            kernels = {k: min(r["per_kernel_ms"][k] for r in rows) for k in rows[0]["per_kernel_ms"]
                       if k.startswith("_")}
            print(f"  {tree:28s} {min(ms):7.3f}-{max(ms):7.3f}  "
                  + ", ".join(f"{k} {v:.3f}" for k, v in kernels.items()))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"ab_{script}.json"), "w") as f:
        json.dump({"env": C.environment(), "trees": args.trees, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
