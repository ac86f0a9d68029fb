"""The gradient error of the one-kernel backward's proposed numerics (CPU emulation), next
to today's backward's.

    python benchmarks/lab/grad_error_fused.py [--n 1024 2048] [--d 128 64] [--heads 2]

The proposal (the FlashAttention-3-structured kernel, one program per 128-key block that
walks the query steps): P, dO (E5M2 per head), dP and delta as today; then per step of
``BM`` queries (64 at D = 128, 128 at D = 64)

- dV += Pᵀ·dO accumulated across steps (in the wgmma accumulator);
- dK += dSᵀ·Qe across steps, dS·qe_scale as E4M3 with one power-of-two scale per key that
  only grows (``running_pow2``): when a step's amax needs a larger one, that key's
  accumulator row is multiplied by the (exact) power-of-two ratio first;
- dQ += dS16·K16 summed in float32 over the key blocks, dS16 a 16-bit copy of dS times the
  block's K scale, K16 the 8-bit K codes (exact in a 16-bit float).

Variants price each choice: the 16-bit type (bf16, or fp16 with a per-head power-of-two
scale from a bound on |dS|), K's codes for dQ (the forward's INT8 or the E4M3 view today's
dQ uses), dK's dS (the running scale, a fresh per-step one, or 16-bit like dQ's), and a
model of the FP8 wgmma's accumulator, which keeps about 14 significant bits (DeepSeek-V3,
section 3.3.2): with ``acc_bits`` the dV and dK sums are cut toward zero to that many bits
after each 32-deep product, as accumulating across steps inside the wgmma would.  That is
a model, not the hardware's exact rule; the H200 decides.

MHA only (no GQA): the kernel's running scale would span a group's heads.  Writes
grad_error_fused.json into --out-dir (default benchmarks/results/lab).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402
from lab.grad_error_budget import gradients, rel_l2  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor import reference as R  # noqa: E402
from fp4_inductor.attention import lowp_attention  # noqa: E402

F16_MAX = 65504.0


@dataclass(frozen=True)
class Choice:
    ds16: torch.dtype = torch.bfloat16  # dQ's dS operand
    k_codes: str = "int8"  # dQ's K operand: "int8" (k8) or "e4m3" (ke)
    dk: str = "running_pow2"  # "running_pow2" | "step_pow2" (a fresh scale per step) | "ds16"
    acc_bits: int | None = None  # FP8 wgmma accumulator model; None: float32


def _cut(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """``x`` cut toward zero to ``bits`` significant bits (None: unchanged)."""
    if bits is None:
        return x
    m, e = torch.frexp(x)
    return torch.ldexp(torch.trunc(m * 2.0**bits) / 2.0**bits, e)


def _fp8_mma(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int | None) -> torch.Tensor:
    """acc + a·b with the accumulator model: a wgmma contracts 32 deep for 8-bit operands."""
    if bits is None:
        return acc + a @ b
    for c in range(0, a.shape[-1], 32):
        acc = _cut(acc + a[..., c:c + 32] @ b[..., c:c + 32, :], bits)
    return acc


def _pow2_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e with amax / 2**e <= 448 (E4M3's largest), floored at formats.DS_SCALE_MIN's."""
    e = torch.ceil(torch.log2(amax / F.E4M3_MAX))
    return torch.nan_to_num(e, neginf=-126.0).clamp(min=-126.0)


def fused_backward(choice, do8, do_scale, delta, q8, k8, v8t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale,
                   bias, row_ref, causal, p_mode, out_dtype, diagonal=0, window=0):
    """``reference.attention_backward``'s signature and meaning, with ``choice``'s numerics."""
    assert q8.shape[1] == k8.shape[1], "MHA only (module docstring)"
    nq, nk, d = q8.shape[-2], k8.shape[-2], q8.shape[-1]
    do = do8.float() * do_scale[..., None, None]
    v = v8t.transpose(-1, -2).float() * v_scale[..., None, None]
    r = row_ref.float()
    # ke_scale arrives times the softmax scale (attention.py): its ratio to Ke's own is it.
    ke_own = F.backward_operands(q8, q_scale, k8, k_scale)[3]
    sm_scale = (ke_scale[..., :1] / ke_own[..., :1])[..., None]
    if choice.k_codes == "int8":
        k16, k_block = k8.float(), k_scale
    else:
        k16, k_block = ke.float(), ke_own
    k_key = F.expand_block_scale(k_block, nk)  # each key's block scale, folded into dS16
    ds16_scale = torch.ones_like(do_scale)[..., None, None]
    if choice.ds16 == torch.float16:  # a power of two per head that keeps max|dS k_scale| <= F16_MAX
        bound = 2.2 * d * do8.float().abs().amax((-2, -1)) * do_scale * v8t.float().abs().amax((-2, -1)) * v_scale
        bound = bound * k_block.amax(-1)
        ds16_scale = torch.exp2(torch.floor(torch.log2(F16_MAX / bound)))[..., None, None]
    qe_row = F.expand_block_scale(qe_scale, nq)
    bm = 64 if d > 64 else 128
    dq = torch.zeros(q8.shape)
    dk = torch.zeros(k8.shape)
    dv = torch.zeros(k8.shape[:-1] + (v8t.shape[-2],))
    exp_k = torch.full(k8.shape[:-1], -126.0)  # the running per-key exponents
    for start in range(0, nq, bm):
        rows = slice(start, min(start + bm, nq))
        x = R.log2_scores(q8, k8, q_scale, k_scale, bias, causal, slice(0, nk), rows, diagonal, window)
        p = R._probability(x, r[..., rows, None], p_mode)
        ds = p * (do[..., rows, :] @ v.transpose(-1, -2) - delta[..., rows, None])
        dv = _fp8_mma(dv, p.transpose(-1, -2), do[..., rows, :], choice.acc_bits)
        ds16 = (ds * k_key[..., None, :] * ds16_scale).to(choice.ds16).float()
        dq[..., rows, :] = ds16 @ k16 * (sm_scale / ds16_scale)  # the postprocess's factor
        dst = ds.transpose(-1, -2) * qe_row[..., None, rows]  # [keys, queries], qe_scale folded in
        if choice.dk == "ds16":
            dk = dk + dst.to(choice.ds16).float() @ qe.float()[..., rows, :]
            continue
        step_exp = _pow2_exponent(dst.abs().amax(-1))
        if choice.dk == "running_pow2":
            new = torch.maximum(exp_k, step_exp)
            dk = dk * torch.exp2(exp_k - new)[..., None]  # exact: a power of two
            exp_k = new
            codes = F._cast(dst / torch.exp2(exp_k)[..., None], F.E4M3, F.E4M3_MAX).float()
            dk = _fp8_mma(dk, codes, qe.float()[..., rows, :], choice.acc_bits)
        else:  # a fresh scale per step, summed in float32 (two-level, as today's kernel)
            codes = F._cast(dst / torch.exp2(step_exp)[..., None], F.E4M3, F.E4M3_MAX).float()
            dk = dk + (codes @ qe.float()[..., rows, :]) * torch.exp2(step_exp)[..., None]
    if choice.dk == "running_pow2":
        dk = dk * torch.exp2(exp_k)[..., None]
    return dq.to(out_dtype), dk.to(out_dtype), dv.to(out_dtype)


VARIANTS = {
    "proposal: bf16 dS x int8 K (dQ), running pow2 E4M3 dS (dK), fp32 accumulation": Choice(),
    "  dQ's dS fp16 (per-head pow2 scale)": Choice(ds16=torch.float16),
    "  dQ's K the E4M3 view (today's dQ operand)": Choice(k_codes="e4m3"),
    "  dK's dS with a fresh pow2 scale per step (two-level sums)": Choice(dk="step_pow2"),
    "  dK's dS bf16 as dQ's (16-bit dK product)": Choice(dk="ds16"),
    "  + FP8 wgmma accumulator model (14 bits) for dV, dK": Choice(acc_bits=14),
    "  + accumulator model, 13 bits": Choice(acc_bits=13),
    "  dK bf16 dS + accumulator model for dV (14 bits)": Choice(dk="ds16", acc_bits=14),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--d", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    rows = []
    for d in args.d:
        for n in args.n:
            torch.manual_seed(d + n)
            q, k, v = (torch.randn(1, args.heads, n, d, requires_grad=True) for _ in range(3))
            dout = torch.randn(1, args.heads, n, d)
            exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
            want = gradients(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                             exact, dout.double())
            print(f"\nD={d}, N={n}, {args.heads} heads, causal: rel-L2 vs float64 (dQ / dK / dV / all)")
            for name, choice in [("today's backward (reference.attention_backward)", None)] + list(VARIANTS.items()):
                patch = (mock.patch.object(R, "attention_backward",
                                           lambda *a, c=choice: fused_backward(c, *a)) if choice else mock.MagicMock())
                with patch:
                    got = gradients(lambda q, k, v: lowp_attention(q, k, v, is_causal=True), [q, k, v], dout)
                errs = [rel_l2(a, b) for a, b in zip(got, want)]
                total = math.sqrt(sum((a - b).norm() ** 2 for a, b in zip(got, want))
                                  / sum(b.norm() ** 2 for b in want))
                rows.append({"d": d, "n": n, "heads": args.heads, "variant": name.strip(), "dq": errs[0],
                             "dk": errs[1], "dv": errs[2], "all": total})
                print(f"  {name:82s} {errs[0]:.4f} / {errs[1]:.4f} / {errs[2]:.4f} / {total:.4f}", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "grad_error_fused.json"), "w") as f:
        json.dump({"env": C.environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
