"""A key-padded training step (what an HF model trained on a padded batch runs) with the
Triton kernels walking every key tile and skipping the wholly masked ones
(``kernels/triton/key_bias.TRITON_SKIPS_MASKED_TILES``), in the same run; torch's BF16
SDPA on the dense boolean mask (what such a site falls back to) as the peer.

    python benchmarks/lab/explore_padded_training.py [--ns 2048 4096 8192]

``lowp_attention(q, k, v, key_padding=keep, is_causal=...)`` forward + backward, fp8,
B = 16384 // N, H = 2048 // D, each sequence keeping N/2..N keys (seeded per case, as
``explore_masked_sites.py``).  The gradients of both switch states are compared (the
kernels sum nothing atomically, so they should agree bit for bit).  Writes
benchmarks/results/lab/explore_padded_training_h200.json.
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
from explore_masked_sites import SIDES, dense_mask, key_padding  # noqa: E402

from fp4_inductor.attention import lowp_attention  # noqa: E402
from fp4_inductor.kernels.triton import key_bias  # noqa: E402


def step(q, k, v, dout, causal, keep, skipping):
    """One forward + backward; the gradients."""
    with mock.patch.object(key_bias, "TRITON_SKIPS_MASKED_TILES", skipping):
        out = lowp_attention(q, k, v, is_causal=causal, key_padding=keep)
        return torch.autograd.grad(out, (q, k, v), dout)


def sdpa_step(q, k, v, dout, mask):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.autograd.grad(out, (q, k, v), dout)


def main(ns):
    doc = {"environment": C.environment(), "rows": []}
    for d in (128, 64):
        for n in ns:
            for causal, side in tqdm(SIDES, desc=f"D {d} N {n}"):
                torch.manual_seed(0)
                b, h = C.fa3_shape(n, d)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                dout = torch.randn_like(q)
                gen = torch.Generator().manual_seed(d * 10**6 + n * 10 + 2 * causal + (side == "left"))
                keep = key_padding(b, n, side, gen).cuda()
                mask = dense_mask(keep.cpu(), n, causal, 0).cuda()
                grads = {s: step(q, k, v, dout, causal, keep, s) for s in (False, True)}
                row = {"d": d, "n": n, "causal": causal, "mask": side, "b": b, "h": h,
                       "visible_fraction": float(mask.float().mean()),
                       "max_abs_grad_diff": max((a - c).abs().max().item()
                                                for a, c in zip(grads[False], grads[True]))}
                runs = {"all_tiles": lambda: step(q, k, v, dout, causal, keep, False),
                        "skipping": lambda: step(q, k, v, dout, causal, keep, True),
                        "sdpa_bf16_dense_mask": lambda: sdpa_step(q, k, v, dout, mask)}
                for name, fn in runs.items():
                    # Wall time (eager: the host's launches count) and the kernels' own time.
                    row[f"{name}_ms"] = do_bench(fn, return_mode="median")
                    kernels = C.kernel_times(fn)
                    row[f"{name}_kernel_ms"] = sum(kernels.values())
                    row[f"{name}_top_kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6])
                row["skip_speedup"] = row["all_tiles_ms"] / row["skipping_ms"]
                row["skip_kernel_speedup"] = row["all_tiles_kernel_ms"] / row["skipping_kernel_ms"]
                row["sdpa_over_skipping_kernels"] = row["sdpa_bf16_dense_mask_kernel_ms"] / row["skipping_kernel_ms"]
                doc["rows"].append(row)
                del q, k, v, dout, grads, mask
    C.save(doc, os.path.join(C.RESULTS, "lab", "explore_padded_training_h200.json"))
    print(f"{'D':>4s} {'N':>6s} {'causal':>6s} {'mask':>6s} {'vis':>5s}  wall ms: all tiles / skipping / SDPA"
          f"  kernel ms: all tiles / skipping (speedup) / SDPA-dense-mask (over skipping)  max |grad diff|")
    for r in doc["rows"]:
        print(f"{r['d']:4d} {r['n']:6d} {str(r['causal']):>6s} {r['mask']:>6s} {r['visible_fraction']:5.2f}  "
              f"{r['all_tiles_ms']:7.3f} / {r['skipping_ms']:7.3f} / {r['sdpa_bf16_dense_mask_ms']:7.3f}  "
              f"{r['all_tiles_kernel_ms']:7.3f} / {r['skipping_kernel_ms']:7.3f} ({r['skip_kernel_speedup']:.2f})"
              f" / {r['sdpa_bf16_dense_mask_kernel_ms']:7.3f} ({r['sdpa_over_skipping_kernels']:.2f})"
              f"  {r['max_abs_grad_diff']:.2e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="*", default=[2048, 4096, 8192], help="sequence lengths")
    main(ap.parse_args().ns)
