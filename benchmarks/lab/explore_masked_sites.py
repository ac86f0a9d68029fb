"""Masked sites against the unmasked kernel on the same visible work (issue: masked sites
within 5 % of the unmasked kernel): key padding (``kernels/triton/key_bias.py``) and a
4096-key sliding window, P mode direct.  Per case: the Gluon forward with the mask, the
Triton kernel on the same mask (which ran every padded site before), the Gluon kernel
without it (plain causal for the window) on the same quantized operands; what the backend
runs (``quantized.quantized_forward``: quantization, the bias, the dispatch); the peers: torch's
BF16 SDPA on the dense boolean mask an HF model in sdpa mode builds (what such a site
falls back to) and FlashAttention-4 BF16 (``fa4_peer``: varlen for padding, its own
window), where installed.

    python benchmarks/lab/explore_masked_sites.py [--ns 2048 4096 8192 16384]

B = 16384 // N sequences of H = 2048 // D heads; each padded sequence keeps a random
number of keys between N/2 and N (seeded), at its end (right padding, training batches)
or its start (left padding, generation), causal or not.  TFLOP/s are counted on the
visible (query, key) pairs, so a kernel that skips the masked tiles and loses nothing on
the edge tiles matches the unmasked kernel's TFLOP/s.  Writes
benchmarks/results/lab/explore_masked_sites_h200.json, which ``cost_table.py --masked``
turns into the policy's rates for those mask kinds.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch
from tqdm import tqdm
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor.quantized import quantized_forward  # noqa: E402
from fp4_inductor.kernels.gluon import attention_fwd as G  # noqa: E402
from fp4_inductor.kernels.triton import attention_fwd as A  # noqa: E402

WINDOW = 4096
SIDES = ((True, "right"), (True, "left"), (False, "right"))
MASK_KINDS = {"right": "padding", "left": "padding", "window": f"window {WINDOW}"}  # Site.mask_kind()'s words


def cases(ns):
    """Padding at every N, the window from N = 2 windows; D = 128 then 64."""
    return ([(d, n, causal, side) for d in (128, 64) for n in ns for causal, side in SIDES]
            + [(d, n, True, "window") for d in (128, 64) for n in ns if n >= 2 * WINDOW])


def key_padding(b: int, n: int, side: str, generator) -> torch.Tensor:
    """[B, N] booleans, True for kept keys: between N/2 and N of them per sequence."""
    lengths = torch.randint(n // 2, n + 1, (b,), generator=generator)
    pos = torch.arange(n) if side == "right" else torch.arange(n).flip(0)
    return pos[None, :] < lengths[:, None]


def dense_mask(keep: torch.Tensor | None, n: int, causal: bool, window: int) -> torch.Tensor:
    """What an HF model in sdpa mode hands SDPA: [B or 1, 1, N, N] booleans."""
    mask = F.visible(torch.arange(n)[:, None], torch.arange(n)[None, :], causal, 0, window)
    mask = torch.ones(n, n, dtype=torch.bool) if mask is None else mask
    mask = mask[None, None]
    return mask if keep is None else mask & keep[:, None, None, :]


def fa4_peer(q, k, v, causal, window, keep):
    """FlashAttention-4 BF16 on the same site as its users run it: a window natively;
    padded batches as variable-length sequences of their kept tokens (queries too, as
    HF's flash-attention path unpads them; the packing is not timed), so it skips the
    padded queries that the other kernels compute.  A run callable, or why there is none."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return C.NOT_INSTALLED
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, N, H, D]
    if keep is None:
        def run():
            return flash_attn_func(qt, kt, vt, causal=causal, window_size=(window - 1, 0) if window else (None, None))
    else:
        kept = keep.cuda()
        lengths = kept.sum(1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        longest = int(lengths.max())
        qp, kp, vp = (t[kept] for t in (qt, kt, vt))  # [kept tokens, H, D]

        def run():
            return flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                          max_seqlen_k=longest, causal=causal)
    try:
        with torch.inference_mode():
            run()
    except Exception as err:  # an FA4 build without this feature: recorded, not fatal
        return f"error: {type(err).__name__}: {err}"[:200]
    return run


def _all_tiles(launch):
    with mock.patch.object(A.key_bias, "TRITON_SKIPS_MASKED_TILES", False):
        return launch()


def main(ns):
    doc = {"environment": C.environment(), "window": WINDOW, "rows": []}
    for d, n, causal, side in tqdm(cases(ns)):
        torch.manual_seed(0)
        b, h = C.fa3_shape(n, d)
        (q, k, v), ops = C.quantized_inputs(b, h, h, n, n, d, "direct")
        window = WINDOW if side == "window" else 0
        # Lengths seeded per case: the same paddings whichever --ns a run takes (A/B runs).
        gen = torch.Generator().manual_seed(d * 10**6 + n * 10 + 2 * causal + (side == "left"))
        keep = None if window else key_padding(b, n, side, gen)
        bias = None if keep is None else F.mask_to_log2_bias(None, keep.cuda())
        mask = dense_mask(keep, n, causal, window)
        visible = int(mask.sum()) * h * (b if mask.shape[0] == 1 else 1)
        kind = MASK_KINDS[side] if not causal or window else f"causal+{MASK_KINDS[side]}"
        row = {"d": d, "n": n, "causal": causal, "mask": side, "mask_kind": kind, "window": window, "b": b, "h": h,
               "visible_fraction": visible / (b * h * n * n)}
        # "table": what the policy counts for such a site (SiteShape.flops: the causal
        # structure's pairs, not the padding, which it cannot see), for cost_table.py --masked.
        structure_pairs = int(dense_mask(None, n, causal, window).sum()) * b * h
        flops = {"masked": 4.0 * d * visible, "unmasked": C.attention_flops(b, h, n, n, d, causal),
                 "table": 4.0 * d * structure_pairs}
        dense = mask.cuda()
        structure = {"window": window} if window else {}
        runs = {
            "gluon": ("masked", lambda out: G.attention_forward(*ops, bias, causal, "direct", *out, **structure)),
            "triton": ("masked", lambda out: A.attention_forward(*ops, bias, causal, "direct", *out, **structure)),
            # the same kernel walking every key tile, the wholly masked ones too
            "triton_all_tiles": ("masked", lambda out: _all_tiles(
                lambda: A.attention_forward(*ops, bias, causal, "direct", *out, **structure))),
            "gluon_unmasked": ("unmasked", lambda out: G.attention_forward(*ops, None, causal, "direct", *out)),
            "ours_with_quant": ("masked", lambda out: quantized_forward(q, k, v, bias, d ** -0.5, causal, "fp8",
                                                                        "direct", window=window)),
            "sdpa_bf16_dense_mask": ("masked", lambda out: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=dense)),
        }
        outs = {}
        for name, (work, launch) in runs.items():
            out = C.empty_outputs(b, h, n, d)
            result = launch(out)
            row[f"{name}_ms"] = do_bench(lambda: launch(out), return_mode="median")
            row[f"{name}_visible_tflops"] = flops[work] / row[f"{name}_ms"] / 1e9
            row[f"{name}_table_tflops"] = flops["table"] / row[f"{name}_ms"] / 1e9
            outs[name] = (out[0] if result is None else result if torch.is_tensor(result) else result[0]).float()
        live = outs["triton"].abs().sum(-1) > 0
        row["max_abs_diff_gluon_triton"] = (outs["gluon"] - outs["triton"])[live].abs().max().item()
        ours_err = outs["ours_with_quant"] - outs["sdpa_bf16_dense_mask"]
        row["max_abs_diff_ours_sdpa"] = ours_err[live].abs().max().item()
        row["masked_over_unmasked_tflops"] = row["gluon_visible_tflops"] / row["gluon_unmasked_visible_tflops"]
        row["triton_over_gluon"] = row["triton_ms"] / row["gluon_ms"]
        row["triton_skip_speedup"] = row["triton_all_tiles_ms"] / row["triton_ms"]
        row["max_abs_diff_triton_skip"] = (outs["triton"] - outs["triton_all_tiles"]).abs().max().item()
        row["sdpa_over_ours_with_quant"] = row["sdpa_bf16_dense_mask_ms"] / row["ours_with_quant_ms"]
        fa4 = fa4_peer(q, k, v, causal, window, keep)
        if isinstance(fa4, str):
            row["fa4_bf16_status"] = fa4
        else:
            row["fa4_bf16_ms"] = do_bench(fa4, return_mode="median")
            row["fa4_over_ours_with_quant"] = row["fa4_bf16_ms"] / row["ours_with_quant_ms"]
        doc["rows"].append(row)
        del ops, outs, dense
    C.save(doc, os.path.join(C.RESULTS, "lab", "explore_masked_sites_h200.json"))
    print(f"{'D':>4s} {'N':>6s} {'causal':>6s} {'mask':>6s} {'vis':>5s}  visible TFLOP/s: Gluon masked / unmasked"
          f" (ratio)  Triton/Gluon ms  Triton all tiles / skipping ms  SDPA-dense-mask / ours+quant ms"
          f"  FA4 / ours+quant ms")
    for r in doc["rows"]:
        print(f"{r['d']:4d} {r['n']:6d} {str(r['causal']):>6s} {r['mask']:>6s} {r['visible_fraction']:5.2f}  "
              f"{r['gluon_visible_tflops']:6.0f} / {r['gluon_unmasked_visible_tflops']:6.0f}"
              f" ({r['masked_over_unmasked_tflops']:.3f})  {r['triton_over_gluon']:.2f}  {r['triton_skip_speedup']:.2f}"
              f"  {r['sdpa_over_ours_with_quant']:.2f}  {r.get('fa4_over_ours_with_quant', float('nan')):.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="*", default=[8192, 16384], help="sequence lengths")
    main(ap.parse_args().ns)
