"""Pricing a numerics change on the CPU first: Direct-P codes with a bias as the
reference defines them now, or with the bias folded into the row's offset so that a zero
bias gives the bias-free codes (``docs/perf-notes/2026-12.md``, "Key padding in the Gluon
forward": the Gluon kernel's bias-free tiles would then skip a multiply a score).

    python benchmarks/lab/explore_zero_bias.py [--n 2048] [--d 128]

now:      code = rne(clamp(fl(8 x + 120 - 8 m))),   x = fl(s t + b)     (one FMA, then the code's FMA)
proposed: code = rne(clamp(fl(8 s t + c))),         c = fl(8 b + 120 - 8 m)   (s t unrounded)

Both keep the row reference m = ceil(max x).  Per variant, on Gaussian Q/K/V quantized
as the backend does, with a key-padding bias (0 / masked) and with a random bias row:
the share of codes that differ from the bias-free codes of the same scores (zero-bias
keys only: the proposal's point is that this share is 0), the share that differ between
the variants, and each output's rel-L2 against float64 softmax attention.  Whole rows at
once (m the row's maximum): the tiles' running maximum changes no code's rounding.
Writes explore_zero_bias.json into --out-dir (default benchmarks/results/lab).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402


def codes(st: torch.Tensor, b: torch.Tensor | None, m: torch.Tensor, proposed: bool) -> torch.Tensor:
    """Direct-P codes of float64 exact products ``st`` = s t, bias ``b`` (float32 or None),
    integer row reference ``m``."""
    if b is None:
        return F.direct_p_codes(st, m)
    if not proposed:
        return F.direct_p_codes((st + b.double()).float(), m)
    offset = (8.0 * b.double() + (F.FP8_P_CODE_AT_MAX - 8.0 * m.double())).float()
    return torch.round((st * 8.0 + offset.double()).float().clamp(0.0, F.FP8_P_MAX_CODE))


def attention(st, b, v, proposed):
    """Output with whole-row Direct-P codes; returns (output, codes, row references)."""
    x = st.float() if b is None else (st + b.double()).float()
    m = torch.ceil(x.amax(-1, keepdim=True).double())
    c = codes(st, b, m, proposed)
    p = F.e4m3_value(c)
    return (p @ v) / p.sum(-1, keepdim=True), c, m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    torch.manual_seed(0)
    n, d, h = args.n, args.d, args.heads
    q, k, v = (torch.randn(1, h, n, d) for _ in range(3))
    q8, k8, v_t, q_scale, k_scale, v_scale = F.quantize_inputs(q, k, v, 1.0 / math.sqrt(d), "fp8")
    s = q8.double() @ k8.double().transpose(-1, -2)  # exact integer scores
    t = q_scale.double()[..., None] * F.LOG2E * F.expand_block_scale(k_scale, n).double()[..., None, :]
    st = s * t.float().double()  # the kernels' t is float32
    vq = v_t.float().transpose(-1, -2) * v_scale.float().reshape(1, h, 1, 1)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
    keep = torch.rand(1, 1, 1, n) > 0.3
    biases = {"key padding": torch.where(keep, 0.0, F.MASKED_LOG2).expand(1, h, n, n),
              "random row": (torch.randn(1, h, 1, n) * 2).expand(1, h, n, n)}
    rows = []
    for name, b in biases.items():
        exact = torch.softmax(scores + b.double() * math.log(2.0), -1) @ v.double()  # b in log2 units
        zero = (b == 0).expand_as(st)
        out = {}
        for variant in ("now", "proposed"):
            o, c, m = attention(st, b, vq, variant == "proposed")
            free = codes(st, None, m, False)  # bias-free codes against the same row references
            out[variant] = c
            rows.append({"bias": name, "variant": variant,
                         "rel_l2_vs_fp64": ((o.double() - exact).norm() / exact.norm()).item(),
                         "zero_bias_codes_unlike_bias_free": (c != free)[zero].double().mean().item()
                         if zero.any() else None})
        rows.append({"bias": name, "variant": "differ", "codes_differing": (out["now"] != out["proposed"]).double()
                     .mean().item()})
    doc = {"environment": C.environment(), "n": n, "d": d, "heads": h, "rows": rows}
    C.save(doc, os.path.join(args.out_dir, "explore_zero_bias.json"))
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
