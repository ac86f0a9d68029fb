"""How fast float32 reductions into L2 run on this GPU, in the pattern a dK/dV kernel
that also computes dQ would issue them (``docs/perf-notes/2026-11.md``, "Next: dQ without recomputing").

    python benchmarks/lab/explore_reductions.py [--ns 4096 16384] [--ds 128 64]
    python benchmarks/lab/explore_reductions.py --compile-only   # sm_90 SASS of the TMA variant, no GPU

One program per 128 keys of a head (the dK/dV kernel's grid) walks the query tiles it
sees (causal) and adds a float32 [64, D] tile into dQ per tile: once per 128 keys (both
warpgroups' parts summed first), or twice (each warpgroup's 64 keys on its own).  Against
it, the same programs storing the same tiles (no reduction) and a plain copy of the
bytes, for the ceiling.  The per-thread reductions (``tl.atomic_add``: RED instructions
from every thread) against FlashAttention-3's way: the tile written to shared memory and
added to dQ by one bulk TMA reduce-add (``cp.reduce.async.bulk.tensor``, Gluon), double
buffered so the next tile's store overlaps the last one's reduction.  Prints ms and GB/s of reduced bytes; writes
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
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

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


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """dst[coord:] += src (shared memory) by the TMA unit; Gluon 3.6 has the op, not a wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _dq_parts_tma(dq_desc, NQ, ADDS: gl.constexpr, D: gl.constexpr, BLOCK_KEYS: gl.constexpr,
                  BLOCK_Q: gl.constexpr, BUFFERS: gl.constexpr):
    """``_dq_parts`` with each [BLOCK_Q, D] part stored to shared memory and reduce-added by
    TMA; a buffer is rewritten only once the reduction that read it has (store_wait)."""
    k0 = gl.program_id(0) * BLOCK_KEYS
    bh = gl.program_id(1)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    part = ((rows[:, None] * D + cols[None, :]) % 7).to(gl.float32) * 0.125
    # [head, query, D] tiles: TMA clips a head's last tile at NQ, as the atomics' mask does.
    smem = gl.allocate_shared_memory(gl.float32, [BUFFERS, 1, BLOCK_Q, D], dq_desc.layout)
    i = 0
    for j in range(k0 // BLOCK_Q, gl.cdiv(NQ, BLOCK_Q)):
        for _ in gl.static_range(ADDS):
            buf = smem.index(i % BUFFERS)
            tma.store_wait(BUFFERS - 1)
            buf.reshape([BLOCK_Q, D]).store(part)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [bh, j * BLOCK_Q, 0], buf)
            i += 1
    tma.store_wait(0)


TMA_BUFFERS = 2


def _dq_layout(d):
    return gl.NVMMASharedLayout.get_default_for([1, BLOCK_Q, d], gl.float32)


def compile_tma_for_sm90(d: int, adds: int = 1):
    """The TMA variant compiled for sm_90 without a GPU (Triton's bundled ptxas)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    desc = f"tensordesc<fp32[1, {BLOCK_Q}, {d}],{_dq_layout(d)!r}>"
    consts = dict(ADDS=adds, D=d, BLOCK_KEYS=BLOCK_KEYS, BLOCK_Q=BLOCK_Q, BUFFERS=TMA_BUFFERS)
    sig = {"dq_desc": desc, "NQ": "i32", **{name: "constexpr" for name in consts}}
    return triton.compile(GluonASTSource(_dq_parts_tma, sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def measure(b, h, n, d):
    from triton.testing import do_bench

    dq = torch.zeros(b * h, n, d, device="cuda", dtype=torch.float32)
    grid = (triton.cdiv(n, BLOCK_KEYS), b * h)
    tiles = sum(triton.cdiv(n, BLOCK_Q) - k0 // BLOCK_Q for k0 in range(0, n, BLOCK_KEYS))
    desc = TensorDescriptor.from_tensor(dq, [1, BLOCK_Q, d], _dq_layout(d))

    def atomics(out, adds, reduce):
        _dq_parts[grid](out, n, ADDS=adds, REDUCE=reduce, D=d, BLOCK_KEYS=BLOCK_KEYS, BLOCK_Q=BLOCK_Q, num_warps=4)

    def by_tma(adds):
        _dq_parts_tma[grid](desc, n, ADDS=adds, D=d, BLOCK_KEYS=BLOCK_KEYS, BLOCK_Q=BLOCK_Q, BUFFERS=TMA_BUFFERS,
                            num_warps=4)

    rows = []

    def timed(name, adds, run):
        ms = do_bench(run, return_mode="median")
        gb = b * h * tiles * adds * BLOCK_Q * d * 4 / 1e9
        rows.append({"what": name, "ms": ms, "GB": gb, "GB/s": gb / ms * 1e3})

    for name, adds, reduce in (("reduce, 1 per 128 keys", 1, True), ("reduce, 1 per 64 keys", 2, True),
                               ("store, 1 per 128 keys", 1, False)):
        timed(name, adds, lambda: atomics(dq, adds, reduce))
    for name, adds in (("TMA reduce, 1 per 128 keys", 1), ("TMA reduce, 1 per 64 keys", 2)):
        dq.zero_()
        by_tma(adds)
        expected = torch.zeros_like(dq)
        atomics(expected, adds, True)
        assert torch.equal(dq, expected), f"{name}: the TMA reduction's sums differ from the atomics'"
        timed(name, adds, lambda: by_tma(adds))
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
    ap.add_argument("--compile-only", action="store_true", help="SASS counts of the TMA variant, no GPU")
    args = ap.parse_args()
    if args.compile_only:
        from inspect_sass import count_ops, disassemble

        for d in args.ds:
            sass, regs, spill = disassemble(compile_tma_for_sm90(d).asm["cubin"])
            ops = count_ops(sass)
            print(f"D={d}: {regs} registers, {spill} spill bytes, "
                  + ", ".join(f"{op} {ops[op]}" for op in sorted(ops) if "RED" in op or "TMA" in op or "BLK" in op))
        return
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
