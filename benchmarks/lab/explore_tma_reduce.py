"""The one-kernel backward's main risk, measured first: how fast 132 persistent programs add
16 KB float32 chunks from shared memory into a global float32 dQ accumulator with the TMA
reduce (``cp.reduce.async.bulk.tensor.add``), for working sets inside and beyond L2.

    python benchmarks/lab/explore_tma_reduce.py --out results.json      # H200
    python benchmarks/lab/explore_tma_reduce.py --compile-only          # any machine: sm_90 PTX/SASS check

Each program holds BUFS chunks [64, 64] (a consumer warpgroup's dQ partial at D = 128: 64
queries by half the head dim) and at step i reduces buffer i % BUFS into chunk
(p·stride + i) mod n_chunks, ``stride = n_chunks // programs``: programs walk consecutive
chunks from evenly spread starts, so at any step they hit distinct chunks, as the fused
kernel's programs (key blocks of one head, at staggered query tiles) do.  Before reusing a
buffer a program waits until its previous reduce has read it (``tma.store_wait``), as the
kernel must.  The chunks' values are not rewritten between steps: this is the reduce's own
rate.  The same loop with a plain TMA store is the bandwidth reference.

Reported: payload GB/s (16 KB per reduce; each reduce reads and writes its chunk in L2),
do_bench medians, and whether one launch's sums equal torch's (index_add over the same
schedule, float32 order aside).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402

from fp4_inductor.kernels.gluon.attention_bwd_fused import _reduce_add as async_reduce_add  # noqa: E402
from fp4_inductor.kernels.gluon.attention_fwd import _compile_sm90, _layout, _tensor_desc  # noqa: E402

CHUNK = [64, 64]  # float32: 16 KB
CHUNK_BYTES = CHUNK[0] * CHUNK[1] * 4
PROGRAMS = 132  # one per SM


@gluon.jit
def _probe(src_ptr, acc_desc, n_chunks, stride, steps, ROWS: gl.constexpr, COLS: gl.constexpr, BUFS: gl.constexpr,
           REDUCE: gl.constexpr):
    pid = gl.program_id(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    bufs = gl.allocate_shared_memory(gl.float32, [BUFS, ROWS, COLS], acc_desc.layout)
    for b in gl.static_range(BUFS):  # program p's buffer b holds src[p, b]
        bufs.index(b).store(gl.load(src_ptr + ((pid * BUFS + b) * ROWS + rows[:, None]) * COLS + cols[None, :]))
    fence_async_shared()
    for i in range(steps):
        tma.store_wait(BUFS - 1)  # buffer i % BUFS: its reduce of step i - BUFS has read it
        chunk = (pid * stride + i) % n_chunks
        if REDUCE:
            async_reduce_add(acc_desc, [chunk * ROWS, 0], bufs.index(i % BUFS))
        else:
            tma.async_copy_shared_to_global(acc_desc, [chunk * ROWS, 0], bufs.index(i % BUFS))
    tma.store_wait(0)


BUFS = 2  # two consumer warpgroups' chunks in flight


def _launch(src, acc, desc, n_chunks, steps, reduce):
    _probe[(PROGRAMS,)](src, desc, n_chunks, max(1, n_chunks // PROGRAMS), steps, ROWS=CHUNK[0], COLS=CHUNK[1],
                        BUFS=BUFS, REDUCE=reduce, num_warps=4)


def expected_sum(src, n_chunks, steps):
    """What one launch adds into a zero accumulator, by torch."""
    out = torch.zeros(n_chunks, CHUNK[0] * CHUNK[1], device=src.device)
    stride = max(1, n_chunks // PROGRAMS)
    i = torch.arange(steps, device=src.device)
    flat = src.view(PROGRAMS, BUFS, -1)
    for p in range(PROGRAMS):
        for b in range(BUFS):
            hits = i[b::BUFS]
            out.index_add_(0, (p * stride + hits) % n_chunks, flat[p, b].expand(len(hits), -1))
    return out.view(n_chunks * CHUNK[0], CHUNK[1])


def measure(ws_mb: float, payload_gb: float) -> dict:
    n_chunks = max(PROGRAMS, int(ws_mb * 2**20) // CHUNK_BYTES)
    steps = max(BUFS, int(payload_gb * 1e9 / (PROGRAMS * CHUNK_BYTES)))
    torch.manual_seed(0)
    src = torch.randn(PROGRAMS, BUFS, *CHUNK, device="cuda")
    acc = torch.zeros(n_chunks * CHUNK[0], CHUNK[1], device="cuda")
    desc = TensorDescriptor.from_tensor(acc, CHUNK, _layout(CHUNK, gl.float32))
    _launch(src, acc, desc, n_chunks, steps, True)
    want = expected_sum(src, n_chunks, steps)
    err = ((acc - want).norm() / want.norm()).item()
    row = {"ws_mb": n_chunks * CHUNK_BYTES / 2**20, "steps": steps, "payload_gb": PROGRAMS * steps * CHUNK_BYTES / 1e9,
           "sum_rel_err": err, "sum_ok": err < 1e-5}
    for name, reduce in (("reduce", True), ("store", False)):
        ms = triton.testing.do_bench(lambda: _launch(src, acc, desc, n_chunks, steps, reduce), warmup=25, rep=200,
                                     return_mode="median")
        row[f"{name}_ms"] = ms
        row[f"{name}_gbs"] = row["payload_gb"] / (ms * 1e-3)
    return row


def compile_for_sm90(reduce: bool = True):
    """The probe compiled for sm_90 without a GPU (Triton's bundled ptxas)."""
    sig = {"src_ptr": "*fp32", "acc_desc": _tensor_desc("fp32", CHUNK, gl.float32)}
    return _compile_sm90(_probe, sig, dict(ROWS=CHUNK[0], COLS=CHUNK[1], BUFS=BUFS, REDUCE=reduce), dict(num_warps=4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ws-mb", type=float, nargs="+", default=[4, 8, 16, 32, 128, 1024],
                    help="accumulator sizes (H200 L2: 50 MB)")
    ap.add_argument("--payload-gb", type=float, default=2.0, help="bytes reduced per launch")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 and show the TMA instructions")
    args = ap.parse_args()
    if args.compile_only:
        ck = compile_for_sm90()
        ptx = ck.asm["ptx"]
        lines = [line.strip() for line in ptx.splitlines() if "cp.reduce.async.bulk" in line or "bulk.wait" in line]
        print("sm_90 compile ok; TMA reduce in PTX:", *sorted(set(lines)), sep="\n  ")
        from inspect_sass import disassemble, count_ops
        sass, regs, spills = disassemble(ck.asm["cubin"])
        ops = count_ops(sass)
        print(f"regs {regs}, stack {spills}, shared {ck.metadata.shared} B; SASS UBLKRED {ops['UBLKRED']}, "
              f"UTMAREDG {ops['UTMAREDG']}, UTMASTG {ops['UTMASTG']}")
        assert any("cp.reduce.async.bulk.tensor" in line and ".add" in line for line in lines), "no TMA reduce-add"
        return
    rows = []
    print(f"{'ws MB':>8s} {'steps':>6s} {'GB':>6s}  reduce GB/s (ms)   store GB/s (ms)   sum ok")
    for ws in args.ws_mb:
        row = measure(ws, args.payload_gb)
        rows.append(row)
        print(f"{row['ws_mb']:8.1f} {row['steps']:6d} {row['payload_gb']:6.2f}  {row['reduce_gbs']:7.0f} "
              f"({row['reduce_ms']:.3f})   {row['store_gbs']:7.0f} ({row['store_ms']:.3f})   {row['sum_ok']} "
              f"({row['sum_rel_err']:.1e})", flush=True)
    if args.out:
        C.save({"env": C.environment(), "chunk": CHUNK, "programs": PROGRAMS, "bufs": BUFS, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
