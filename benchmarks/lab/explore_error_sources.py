"""Where the fp8 forward's error comes from, and what each remedy could buy: the fp8
Direct-P reference with one operand at a time left exact (Q/K unquantized, V unquantized,
P in float32 instead of E4M3 codes), and two candidate remedies priced before any kernel
work.  CPU: the reference emulation computes the kernels' numbers.

    python benchmarks/lab/explore_error_sources.py   # table; JSON under benchmarks/results/lab/

Remedies: P in E4M3 by exp2 and rounding (P mode "exp": the error Direct-P's
piecewise-linear codes add over plain E4M3 rounding), and V as two E4M3 terms (V ~ s (hi +
s2 lo), lo the E4M3 rounding of what hi leaves, with its own scale s2: a second P.V
product on the same P codes, 2 more bytes a V element).  Inputs as explore_k_smoothing's
(Gaussian, K offset, K offset + rotary, MiniLM layers); rel-L2 against float64 attention.
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import RESULTS  # noqa: E402
from lab.explore_k_smoothing import compare, output_error, synthetic  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor import reference  # noqa: E402


def exact_qk(q, k, sm_scale):
    """Q times the softmax scale and the smoothed K, unrounded, as 'codes' with unit scales."""
    ones_k = torch.ones(*k.shape[:2], F.scale_blocks(k.shape[-2]))
    return q.double() * sm_scale, torch.ones(q.shape[:3]), F.smooth_k(k).double(), ones_k


def v_hi_lo(v):
    """V as s (hi + s2 lo): two per-head-scaled E4M3 terms, the second for the first's residual."""
    v8t, v_scale = F.quantize_v(v, "fp8")
    hi = v8t.float() * v_scale[..., None, None]
    residual = v.float().transpose(-1, -2) - hi
    lo8t, lo_scale = F.quantize_v(residual.transpose(-1, -2), "fp8")
    return hi + lo8t.float() * lo_scale[..., None, None]


def float32_p(x, m, p_mode):
    return torch.exp2(x.double() - m + 8.0).float()


def error_with(flags, q, k, v, causal) -> float:
    """Output rel-L2 with the operands ``flags`` names left exact or remedied."""
    sm_scale = q.shape[-1] ** -0.5
    q8, k8, v_t, q_scale, k_scale, v_scale = F.quantize_inputs(q, k, v, sm_scale, "fp8")
    if "exact Q/K" in flags:
        q8, q_scale, k8, k_scale = exact_qk(q, k, sm_scale)
    if "exact V" in flags:
        v_t, v_scale = v.float().transpose(-1, -2).contiguous(), torch.ones(v.shape[:2])
    if "V hi+lo" in flags:
        v_t, v_scale = v_hi_lo(v), torch.ones(v.shape[:2])
    ops = (q8, k8, v_t, q_scale, k_scale, v_scale)
    p_mode = "exp" if "exp P" in flags else "direct"
    exact_p = mock.patch.object(F, "probability_operand", float32_p) if "float32 P" in flags else contextlib.nullcontext()
    with exact_p:
        return output_error(ops, q, k, v, causal, p_mode)


VARIANTS = {
    "fp8 (shipped)": (),
    "only P rounded (Q/K, V exact)": ("exact Q/K", "exact V"),
    "only V rounded": ("exact Q/K", "float32 P"),
    "only Q/K rounded": ("exact V", "float32 P"),
    "remedy: P by exp2 + E4M3 rounding": ("exp P",),
    "remedy: V hi+lo": ("V hi+lo",),
    "both remedies": ("exp P", "V hi+lo"),
}


def main():
    compare(synthetic(2048, 128, 4, torch.Generator().manual_seed(0)), VARIANTS, error_with,
            os.path.join(RESULTS, "lab", "explore_error_sources.json"))


if __name__ == "__main__":
    main()
