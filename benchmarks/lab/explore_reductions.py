"""How fast float32 reductions into L2 run on this GPU, in the pattern a dK/dV kernel
that also computes dQ would issue them (``docs/perf-notes.md``, "dQ without recomputing").

    python benchmarks/explore_reductions.py [--ns 4096 16384] [--ds 128 64]

One program per 128 keys of a head (the dK/dV kernel's grid) walks the query tiles it
sees (causal) and adds a float32 [64, D] tile into dQ per tile: once per 128 keys (both
warpgroups' parts summed first), or twice (each warpgroup's 64 keys on its own).  Against
it, the same programs storing the same tiles (no reduction) and a plain copy of the
bytes, for the ceiling.  Prints ms and GB/s of reduced bytes; writes
explore_reductions.json into --out-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402

BLOCK_KEYS, BLOCK_Q = 128, 64


@triton.jit
def _dq_parts(dq, NQ, ADDS: tl.constexpr, REDUCE: tl.constexpr, D: tl.constexpr, BLOCK_KEYS: tl.constexpr,
              BLOCK_Q: tl.constexpr):
    """dQ[b h, tile] += a [BLOCK_Q, D] part for every query tile at or after this program's
    keys (causal), ADDS times a tile; REDUCE=False stores instead (the traffic without the
    reduction)."""
    k0 = tl.program_id(0) * BLOCK_KEYS
    base = dq + tl.program_id(1).to(tl.int64) * NQ * D
    offs = tl.arange(0, BLOCK_Q)[:, None] * D + tl.arange(0, D)[None, :]
    part = (offs % 7).to(tl.float32) * 0.125
    for j in range(k0 // BLOCK_Q, tl.cdiv(NQ, BLOCK_Q)):
        ptrs = base + j * BLOCK_Q * D + offs
        ok = (j * BLOCK_Q + tl.arange(0, BLOCK_Q) < NQ)[:, None]
        for _ in tl.static_range(ADDS):
            if REDUCE:
                tl.atomic_add(ptrs, part, mask=ok, sem="relaxed")
            else:
                tl.store(ptrs, part, mask=ok)


def measure(b, h, n, d):
    dq = torch.zeros(b * h, n, d, device="cuda", dtype=torch.float32)
    grid = (triton.cdiv(n, BLOCK_KEYS), b * h)
    tiles = sum(triton.cdiv(n, BLOCK_Q) - k0 // BLOCK_Q for k0 in range(0, n, BLOCK_KEYS))
    rows = []
    for name, adds, reduce in (("reduce, 1 per 128 keys", 1, True), ("reduce, 1 per 64 keys", 2, True),
                               ("store, 1 per 128 keys", 1, False)):
        run = lambda: _dq_parts[grid](dq, n, ADDS=adds, REDUCE=reduce, D=d, BLOCK_KEYS=BLOCK_KEYS,  # noqa: E731
                                      BLOCK_Q=BLOCK_Q, num_warps=4)
        ms = do_bench(run, return_mode="median")
        gb = b * h * tiles * adds * BLOCK_Q * d * 4 / 1e9
        rows.append({"what": name, "ms": ms, "GB": gb, "GB/s": gb / ms * 1e3})
    src = torch.empty(int(rows[0]["GB"] * 1e9) // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    rows.append({"what": "copy (GB/s read + written)", "ms": ms, "GB": rows[0]["GB"],
                 "GB/s": 2 * rows[0]["GB"] / ms * 1e3})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--ds", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    result = {"env": C.environment(), "rows": []}
    for d in args.ds:
        for n in args.ns:
            b, h = C.fa3_shape(n, d)
            for row in measure(b, h, n, d):
                result["rows"].append(dict(row, d=d, n=n, b=b, h=h))
                print(f"D={d:3d} N={n:5d}  {row['what']:26s} {row['ms']:8.3f} ms  {row['GB']:6.2f} GB  "
                      f"{row['GB/s']:7.0f} GB/s")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "explore_reductions.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
