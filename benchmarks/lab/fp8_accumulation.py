"""How much the FP8 wgmma's accumulator loses when dV is summed inside it over a whole
row of query steps (the one-kernel backward of ``docs/staged/fused-backward.patch``),
against one float32 sum a step (the two kernels): a CPU model, calibrated on the H100.

    python benchmarks/lab/fp8_accumulation.py [--ns 1024 4096 16384] [--bits 13 14]

dV = Σ_steps Pᵀ·dO over the query steps of 64 of a 128-key block, P the Direct-P codes and
dO the E5M2 codes of real (Gaussian) inputs through ``formats`` and ``reference``.  The
model: after each 32-deep product (one wgmma K step for 8-bit operands) the accumulator
keeps ``bits`` significant bits, cut toward zero or rounded to nearest (DeepSeek-V3 reports
about 14 bits for Hopper's FP8 accumulation; the hardware's exact rule is not public).
Reported: rel-L2 of each sum against the float64 sum, per length and group size (a GQA
group's heads run one after the other into the same accumulator).  The H100 measured the
fused kernel's dV against its reference at 1.5-2.0e-3 (1k) and 3.2e-3 (4k, causal,
2026-12-05): the model that matches those extrapolates to the lengths that matter.
Writes fp8_accumulation.json into --out-dir (default benchmarks/results/lab).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402
from lab.grad_error_budget import rel_l2  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor import reference as R  # noqa: E402

STEP, K_STEP, KEYS = 64, 32, F.KEY_TILE


def _keep(x: torch.Tensor, bits: int, mode: str) -> torch.Tensor:
    """``x`` with ``bits`` significant bits, cut toward zero or rounded to nearest."""
    mant, exp = torch.frexp(x)
    scaled = mant * 2.0**bits
    kept = torch.trunc(scaled) if mode == "cut" else torch.round(scaled)
    return torch.ldexp(kept / 2.0**bits, exp)


def codes(group: int, n: int, d: int, causal: bool, seed: int):
    """P codes [group, N, keys] of the first 128-key block and dO codes [group, N, D] times
    their scales, float64: what the fused kernel's dV product of one program multiplies."""
    torch.manual_seed(seed)
    q = torch.randn(1, group, n, d)
    k, v = (torch.randn(1, 1, n, d) for _ in range(2))
    q8, k8, vt, qs, ks, vs = F.quantize_inputs(q, k, v, d**-0.5, "fp8")
    _, lse, row_ref = R.attention_forward(q8, k8, vt, qs, ks, vs, None, causal, "direct", torch.float32)
    do8, do_scale = F.quantize_do(torch.randn(1, group, n, d), lse, row_ref, "direct")
    x = R.log2_scores(q8, k8, qs, ks, None, causal, slice(0, KEYS))
    p = R._probability(x, row_ref.float()[..., None], "direct")
    return p[0].double(), do8[0].double() * do_scale[0, :, None, None].double()


def step_sums(p, do):
    """dV [keys, D] of one program summed in float64 and with one float32 sum a query step,
    over the group's heads in order and each head's steps."""
    exact = torch.zeros(p.shape[-1], do.shape[-1], dtype=torch.float64)
    per_step = exact.float()
    for head in range(p.shape[0]):
        for start in range(0, p.shape[1], STEP):
            part = p[head, start:start + STEP].T @ do[head, start:start + STEP]
            exact += part
            per_step += part.float()
    return exact, per_step


def accumulator_sum(p, do, bits, mode):
    """The same dV in the accumulator model: ``bits`` kept after each 32-deep product."""
    model = torch.zeros(p.shape[-1], do.shape[-1], dtype=torch.float64)
    for head in range(p.shape[0]):
        for c in range(0, p.shape[1], K_STEP):
            model = _keep(model + p[head, c:c + K_STEP].T @ do[head, c:c + K_STEP], bits, mode)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--bits", type=int, nargs="+", default=[13, 14])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    rows = []
    print(f"{'group':>5} {'N':>6} {'causal':>6} {'fp32/step':>10} " +
          " ".join(f"{m}{b:>2}".rjust(9) for b in args.bits for m in ("cut", "rn")))
    for group in args.groups:
        for n in args.ns:
            for causal in (True, False):
                p, do = codes(group, n, args.d, causal, seed=n + group)
                exact, per_step = step_sums(p, do)
                row = {"group": group, "n": n, "causal": causal, "fp32_per_step": rel_l2(per_step, exact),
                       "model": {f"{mode}{bits}": rel_l2(accumulator_sum(p, do, bits, mode), exact)
                                 for bits in args.bits for mode in ("cut", "rn")}}
                rows.append(row)
                print(f"{group:5d} {n:6d} {str(causal):>6} {row['fp32_per_step']:10.2e} " +
                      " ".join(f"{row['model'][f'{m}{b}']:9.2e}" for b in args.bits for m in ("cut", "rn")),
                      flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "fp8_accumulation.json"), "w") as f:
        json.dump({"env": C.environment(), "k_step": K_STEP, "step": STEP, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
