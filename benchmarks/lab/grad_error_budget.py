"""Where the training path's gradient error comes from, by format choice (CPU, reference
emulation: the kernels compute the same numbers).

    python benchmarks/grad_error_budget.py [--n 2048] [--d 64 128] [--heads 4]

Gradients of ``lowp_attention`` (causal, Gaussian inputs) against float64 autograd of
exact attention, rel-L2 of dQ, dK, dV, for variants of two format choices the issue
leaves open: the dS scale blocks (``formats.DS_BLOCK_DQ`` and ``ds_block_dk``) and dO's format and scale
granularity (``formats.quantize_do``).  Variants patch ``formats`` for the duration of a
run; the shipped formats are the first row.  Writes grad_error_budget.json into
--out-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor.attention import lowp_attention  # noqa: E402


def _exact_do(do, lse, row_ref, p_mode):
    """dO times the row factor, unquantized (the reference consumes ``codes.float() *
    scale``; a unit scale carries the values)."""
    dof = do.float() * F.backward_row_factor(lse, row_ref, p_mode)[..., None]
    return dof, torch.ones(dof.shape[:2])


def _scaled_do(dtype, fmax, rows):
    """dO times the row factor in ``dtype``, one amax scale per ``rows`` token rows (None:
    per head), returned dequantized with a unit scale."""

    def quantize_do(do, lse, row_ref, p_mode):
        dof, unit = _exact_do(do, lse, row_ref, p_mode)
        n = dof.shape[-2]
        blocks = dof.unflatten(-2, (-1, rows)) if rows else dof.unsqueeze(-3)
        scale = F._amax_scale(blocks.abs().amax(dim=(-2, -1), keepdim=True), fmax)
        values = (F._cast(blocks / scale, dtype, fmax).float() * scale).flatten(-3, -2)
        return values[..., :n, :], unit

    return quantize_do


VARIANTS = {  # name: (dS scale blocks of the dQ and dK products, quantize_do); None: shipped
    "shipped: dS per query x 128 keys (dQ), per key x 128 (D = 64) or 64 queries (dK), dO E5M2 per head": (None, None),
    "dS 64x128 (dQ) and 64x64 (dK) tiles": (((64, 128), (64, 64)), None),
    "dS 128x128": (((128, 128),) * 2, None),
    "dS 64x64": (((64, 64),) * 2, None),
    "dS 32x32": (((32, 32),) * 2, None),
    "dO E5M2 per 128 rows": (None, _scaled_do(F.E5M2, F.E5M2_MAX, 128)),
    "dO E5M2 per row": (None, _scaled_do(F.E5M2, F.E5M2_MAX, 1)),
    "dO E4M3 per head": (None, _scaled_do(F.E4M3, F.E4M3_MAX, None)),
    "dO E4M3 per 128 rows": (None, _scaled_do(F.E4M3, F.E4M3_MAX, 128)),
    "dO E4M3 per row": (None, _scaled_do(F.E4M3, F.E4M3_MAX, 1)),
    "dO E4M3 per 128 rows, dS 64x128 (dQ) and 64x64 (dK) tiles": (((64, 128), (64, 64)), _scaled_do(F.E4M3, F.E4M3_MAX, 128)),
    "dO exact": (None, _exact_do),
    "dS 1x1 (scale per element), dO exact": (((1, 1),) * 2, _exact_do),
}


@contextlib.contextmanager
def patched(ds_blocks, quantize_do):
    saved = F.DS_BLOCK_DQ, F.ds_block_dk, F.quantize_do
    if ds_blocks:
        F.DS_BLOCK_DQ, F.ds_block_dk = ds_blocks[0], lambda head_dim: ds_blocks[1]
    F.quantize_do = quantize_do or F.quantize_do
    try:
        yield
    finally:
        F.DS_BLOCK_DQ, F.ds_block_dk, F.quantize_do = saved


def gradients(fn, inputs, dout):
    for t in inputs:
        t.grad = None
    fn(*inputs).backward(dout)
    return [t.grad.double() for t in inputs]


def rel_l2(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    assert args.n % 128 == 0, "the per-128-row variants take whole blocks"
    rows = []
    for d in args.d:
        torch.manual_seed(d)
        q, k, v = (torch.randn(1, args.heads, args.n, d, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, args.heads, args.n, d)
        exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
        want = gradients(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                         exact, dout.double())
        print(f"\nD={d}, N={args.n}, {args.heads} heads, causal: rel-L2 vs float64 (dQ / dK / dV)")
        for name, (ds_blocks, quantize_do) in VARIANTS.items():
            with patched(ds_blocks, quantize_do):
                got = gradients(lambda q, k, v: lowp_attention(q, k, v, is_causal=True), [q, k, v], dout)
            errs = [rel_l2(a, b) for a, b in zip(got, want)]
            rows.append({"d": d, "n": args.n, "heads": args.heads, "variant": name, "dq": errs[0], "dk": errs[1],
                         "dv": errs[2]})
            print(f"  {name:80s} {errs[0]:.4f} / {errs[1]:.4f} / {errs[2]:.4f}", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "grad_error_budget.json"), "w") as f:
        json.dump({"env": C.environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
