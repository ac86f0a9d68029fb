"""What V's scale granularity costs in accuracy: one E4M3 scale per head (today: its amax
needs a pass over all of V before any code can be written) against one per 128-token
block (each block's program can scale its own tokens: one pass) and one per channel.
CPU: V is quantized at each granularity, dequantized, and the fp8 Direct-P reference runs
with those values (a per-block scale would be folded into the forward's per-tile
rescale and the backward's per-tile dP factor, one multiplication a tile; its float32
rounding is not modelled here).

    python benchmarks/lab/explore_v_scales.py    # table; JSON under benchmarks/results/lab/

Inputs: Gaussian V; V with a few outlier tokens (100x, as attention sinks' values);
V with outlier channels; all-MiniLM-L6-v2's activations on a 512-token text.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import RESULTS  # noqa: E402
from lab.explore_k_smoothing import compare, output_error  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402


def e4m3_values(v: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / F.E4M3_MAX)
    return (v / scale).clamp(-F.E4M3_MAX, F.E4M3_MAX).to(F.E4M3).float() * scale


def per_head(v):
    return e4m3_values(v, v.abs().amax(dim=(-2, -1), keepdim=True))


def per_block(v):
    vb, n = F._block_view(v, F.SCALE_BLOCK)
    return e4m3_values(vb, vb.abs().amax(dim=(-2, -1), keepdim=True)).flatten(-3, -2)[..., :n, :]


def per_channel(v):
    return e4m3_values(v, v.abs().amax(dim=-2, keepdim=True))


VARIANTS = {"per head (today)": per_head, "per 128-token block": per_block, "per channel": per_channel}


def rounded_v_error(round_v, q, k, v, causal) -> float:
    """fp8 Direct-P output with V replaced by ``round_v(v)`` (already rounded), against float64."""
    q8, k8, _, q_scale, k_scale, _ = F.quantize_inputs(q, k, v, q.shape[-1] ** -0.5, "fp8")
    v_t = round_v(v.float()).transpose(-1, -2).contiguous()  # exact E4M3 values times a scale: float32 holds them
    return output_error((q8, k8, v_t, q_scale, k_scale, torch.ones(v.shape[:2])), q, k, v, causal)


def synthetic(gen):
    q, k, v = (torch.randn(1, 4, 2048, 128, generator=gen) for _ in range(3))
    sinks = v.clone()
    sinks[..., torch.randperm(2048, generator=gen)[:8], :] *= 100.0
    channels = v.clone()
    channels[..., torch.randperm(128, generator=gen)[:4]] *= 30.0
    return {"gaussian": (q, k, v), "8 outlier tokens (100x)": (q, k, sinks),
            "4 outlier channels (30x)": (q, k, channels)}


def main():
    compare(synthetic(torch.Generator().manual_seed(0)), VARIANTS, rounded_v_error,
            os.path.join(RESULTS, "lab", "explore_v_scales.json"))

if __name__ == "__main__":
    main()
