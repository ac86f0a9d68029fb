"""The inference path's own Python time a call, on any machine (no GPU needed).

    python benchmarks/lab/explore_forward_host.py [--calls 300] [--profile]

What a compiled graph runs for one attention site in inference, ``fp4attn::quantize``
then ``fp4attn::fwd`` (B 1, H 16, Hkv 4, N 4096, D 128, causal: the Gluon kernel's
case), on CPU tensors, with the device check answered "sm_90" and every kernel launch
(the quantization's two, the Gluon forward's) replaced by a no-op that counts it.  What
remains is ours: the custom-op dispatch, the output allocations, the dispatch checks,
the TMA descriptors, the launchers' argument lists.  Triton's own launch (its argument
binder and the driver call, ~50 us a launch on the H200's host, docs/perf-notes/2026-11.md, "Where a short step's host
time goes") is
not in these numbers.  Rows: each op through ``torch.ops`` and each launcher called
directly, microseconds a call (median of 5 rounds).  ``--profile``: cProfile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import time

import torch

from explore_launcher_host import NoLaunch  # the backward's twin of this probe

from fp4_inductor import kernels, ops  # noqa: F401  (ops registers torch.ops.fp4attn)
from fp4_inductor.kernels.gluon import attention_fwd as gluon_fwd
from fp4_inductor.kernels.triton import quantize as triton_quantize


def per_call_us(fn, calls: int) -> float:
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    kernels.kernels_run_on = lambda device: True
    triton_quantize._stats = triton_quantize._quantize = gluon_fwd._fwd_ws = NoLaunch()
    b, h, hkv, n, d = 1, 16, 4, 4096, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, h, d, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, n, hkv, d, generator=gen, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    scale = 1 / math.sqrt(d)
    operands = torch.ops.fp4attn.quantize(q, k, v, scale, "fp8")
    fwd_args = (*operands, None, True, "direct", torch.bfloat16, 0, 0)
    NoLaunch.launches = 0
    torch.ops.fp4attn.fwd(*fwd_args)
    assert NoLaunch.launches == 1, "the forward did not reach the Gluon kernel's launch"
    lse, row_ref = (torch.empty(b, h, n) for _ in range(2))
    out = ops.bnhd_empty(q, h, n, d, torch.bfloat16)
    rows = {
        "fp4attn::quantize (torch.ops)": lambda: torch.ops.fp4attn.quantize(q, k, v, scale, "fp8"),
        "  its launcher": lambda: triton_quantize.quantize_inputs(q, k, v, scale),
        "fp4attn::fwd (torch.ops)": lambda: torch.ops.fp4attn.fwd(*fwd_args),
        "  kernels._forward (dispatch + launcher)": lambda: kernels._forward(
            *operands, None, True, "direct", out, lse, row_ref, 0, 0),
        "  Gluon launcher alone": lambda: gluon_fwd.attention_forward(
            *operands, None, True, "direct", out, lse, row_ref, 0, 0),
    }
    for name, fn in rows.items():
        fn()
        print(f"{name:45s} {per_call_us(fn, args.calls):7.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [(rows["fp4attn::quantize (torch.ops)"](), rows["fp4attn::fwd (torch.ops)"]())
                              for _ in range(200)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
