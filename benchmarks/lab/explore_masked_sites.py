"""Key-padded sites against the unmasked kernel on the same visible work (issue: masked
sites within 5 % of the unmasked kernel): the Gluon forward with a key-padding bias row
(``kernels/gluon/key_bias.py``), the Triton kernel on the same bias, and the Gluon kernel
without a mask, P mode direct, on the same quantized operands.

    python benchmarks/lab/explore_masked_sites.py

B = 16384 // N sequences of H = 2048 // D heads; each sequence keeps a random number of
keys between N/2 and N (seeded), at its end (right padding, training batches) or its
start (left padding, generation), causal or not.  TFLOP/s are counted on the visible
(query, key) pairs, so a kernel that skips the padded tiles and loses nothing on the edge
tiles matches the unmasked kernel's TFLOP/s.  Writes
benchmarks/results/lab/explore_masked_sites_h200.json.
"""

from __future__ import annotations

import os
import sys

import torch
from tqdm import tqdm
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor.kernels.gluon import attention_fwd as G  # noqa: E402
from fp4_inductor.kernels.triton import attention_fwd as A  # noqa: E402

CASES = [(d, n, causal, side) for d in (128, 64) for n in (4096, 8192)
         for causal, side in ((True, "right"), (True, "left"), (False, "right"))]


def key_padding(b: int, n: int, side: str, generator) -> torch.Tensor:
    """[B, N] booleans, True for kept keys: between N/2 and N of them per sequence."""
    lengths = torch.randint(n // 2, n + 1, (b,), generator=generator)
    pos = torch.arange(n) if side == "right" else torch.arange(n).flip(0)
    return pos[None, :] < lengths[:, None]


def visible_pairs(keep: torch.Tensor, causal: bool) -> int:
    """(query, key) pairs with P possibly non-zero, summed over sequences (one head)."""
    n = keep.shape[1]
    if not causal:
        return int(keep.sum()) * n
    # query i sees kept keys j <= i: the running count of kept keys
    return int(keep.long().cumsum(1).sum())


def main():
    doc = {"environment": C.environment(), "rows": []}
    gen = torch.Generator().manual_seed(0)
    for d, n, causal, side in tqdm(CASES):
        torch.manual_seed(0)
        b, h = C.fa3_shape(n, d)
        _, ops = C.quantized_inputs(b, h, h, n, n, d, "direct")
        keep = key_padding(b, n, side, gen)
        bias = F.mask_to_log2_bias(None, keep.cuda())
        row = {"d": d, "n": n, "causal": causal, "padding": side, "b": b, "h": h,
               "kept_fraction": keep.float().mean().item()}
        masked_flops = 4.0 * h * d * visible_pairs(keep, causal)
        plain_flops = C.attention_flops(b, h, n, n, d, causal)
        outs = {}
        for name, launch, mask, flops in (("gluon_padded", G.attention_forward, bias, masked_flops),
                                          ("triton_padded", A.attention_forward, bias, masked_flops),
                                          ("gluon_unmasked", G.attention_forward, None, plain_flops)):
            out = C.empty_outputs(b, h, n, d)
            run = lambda: launch(*ops, mask, causal, "direct", *out)  # noqa: E731
            run()
            row[f"{name}_ms"] = do_bench(run, return_mode="median")
            row[f"{name}_visible_tflops"] = flops / row[f"{name}_ms"] / 1e9
            outs[name] = out[0].float()
        live = outs["triton_padded"].abs().sum(-1) > 0
        row["max_abs_diff_gluon_triton"] = (outs["gluon_padded"] - outs["triton_padded"])[live].abs().max().item()
        row["padded_over_unmasked_tflops"] = row["gluon_padded_visible_tflops"] / row["gluon_unmasked_visible_tflops"]
        row["triton_over_gluon_padded"] = row["triton_padded_ms"] / row["gluon_padded_ms"]
        doc["rows"].append(row)
        del ops, outs
    C.save(doc, os.path.join(C.RESULTS, "lab", "explore_masked_sites_h200.json"))
    print(f"{'D':>4s} {'N':>6s} {'causal':>6s} {'pad':>5s} {'kept':>5s}  visible TFLOP/s: Gluon padded / unmasked"
          f"  (ratio)  Triton padded ms / Gluon padded ms")
    for r in doc["rows"]:
        print(f"{r['d']:4d} {r['n']:6d} {str(r['causal']):>6s} {r['padding']:>5s} {r['kept_fraction']:5.2f}  "
              f"{r['gluon_padded_visible_tflops']:6.0f} / {r['gluon_unmasked_visible_tflops']:6.0f}"
              f"  ({r['padded_over_unmasked_tflops']:.3f})  {r['triton_over_gluon_padded']:.2f}")


if __name__ == "__main__":
    main()
