"""A key-padded training step (what an HF model trained on a padded batch runs), three ways
in the same run: the Triton backward kernels walking every key tile, the same skipping the
wholly masked ones (``kernels/triton/key_bias.TRITON_SKIPS_MASKED_TILES``), and the Gluon
dQ and dK/dV kernels taking the key bias (their ``KEY_BIAS``: what ships); torch's BF16
SDPA on the dense boolean mask (what such a site falls back to) as the peer.

    python benchmarks/lab/explore_padded_training.py [--ns 2048 4096 8192] [--compile]

``lowp_attention(q, k, v, key_padding=keep, is_causal=...)`` forward + backward, fp8,
B = 16384 // N, H = 2048 // D, each sequence keeping N/2..N keys (seeded per case, as
``explore_masked_sites.py``); eager, or with ``--compile`` the attention compiled by
Inductor (the peer too, one graph per case), which fuses the backward's elementwise
preparation as a compiled model does.  Wall time and the kernels' own time (profiler).
The gradients of each variant against the all-tiles ones: the Triton skipping should agree
bit for bit (nothing sums atomically), the Gluon kernels to summation order.  A variant
whose Gluon kernel failed falls back to Triton with a warning; the row records which
backward kernels ran.  ``*_table_tflops``: the wall time in the FLOPs the policy counts
for such a site (fwd + bwd of its causal structure, not of the padding it cannot see),
for ``cost_table.py --masked-training``.  Writes
benchmarks/results/lab/explore_padded_training[_compiled]_h200.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

import torch
from tqdm import tqdm
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
from explore_masked_sites import MASK_KINDS, SIDES, dense_mask, key_padding  # noqa: E402

from fp4_inductor.attention import lowp_attention  # noqa: E402
from fp4_inductor.kernels.gluon import attention_bwd_dkdv, attention_bwd_dq  # noqa: E402
from fp4_inductor.kernels.triton import key_bias  # noqa: E402

# variant: (Triton kernels skip masked tiles, Gluon backward takes the key bias)
VARIANTS = {"all_tiles": (False, False), "skipping": (True, False), "gluon_key_bias": (True, True)}


def attend(q, k, v, causal, keep):
    return lowp_attention(q, k, v, is_causal=causal, key_padding=keep)


def sdpa(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def switches(variant):
    skipping, gluon = VARIANTS[variant]
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(key_bias, "TRITON_SKIPS_MASKED_TILES", skipping))
    for module in (attention_bwd_dq, attention_bwd_dkdv):
        stack.enter_context(mock.patch.object(module, "KEY_BIAS", gluon))
    return stack


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(ns, compiled):
    doc = {"environment": C.environment(), "compiled": compiled, "rows": []}
    path = os.path.join(C.RESULTS, "lab", f"explore_padded_training{'_compiled' if compiled else ''}_h200.json")
    for d in (128, 64):
        for n in ns:
            for causal, side in tqdm(SIDES, desc=f"D {d} N {n}"):
                # One graph per case, compiled afresh (no recompile limit reached, no
                # dynamic shapes): the kernels and the step as a model runs it are timed.
                torch._dynamo.reset()
                fwd = torch.compile(attend, dynamic=False) if compiled else attend
                peer = torch.compile(sdpa, dynamic=False) if compiled else sdpa
                torch.manual_seed(0)
                b, h = C.fa3_shape(n, d)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                dout = torch.randn_like(q)
                gen = torch.Generator().manual_seed(d * 10**6 + n * 10 + 2 * causal + (side == "left"))
                keep = key_padding(b, n, side, gen).cuda()
                mask = dense_mask(keep.cpu(), n, causal, 0).cuda()
                kind = f"causal+{MASK_KINDS[side]}" if causal else MASK_KINDS[side]  # Site.mask_kind()'s words
                row = {"d": d, "n": n, "causal": causal, "mask": side, "mask_kind": kind, "b": b, "h": h,
                       "visible_fraction": float(mask.float().mean())}
                table_flops = 3.5 * C.attention_flops(b, h, n, n, d, causal)  # SiteShape.flops, training

                def step(variant):
                    with switches(variant):
                        return torch.autograd.grad(fwd(q, k, v, causal, keep), (q, k, v), dout)

                runs = {name: (lambda name=name: step(name)) for name in VARIANTS}
                runs["sdpa_bf16_dense_mask"] = lambda: torch.autograd.grad(peer(q, k, v, mask), (q, k, v), dout)
                grads = {name: step(name) for name in VARIANTS}
                for name in VARIANTS:
                    row[f"{name}_grad_max_abs_diff"] = max((a - c).abs().max().item()
                                                           for a, c in zip(grads[name], grads["all_tiles"]))
                    row[f"{name}_grad_rel_l2"] = max(rel_l2(a, c) for a, c in zip(grads[name], grads["all_tiles"]))
                for name, fn in runs.items():
                    row[f"{name}_ms"] = do_bench(fn, return_mode="median")
                    row[f"{name}_table_tflops"] = table_flops / row[f"{name}_ms"] / 1e9
                    kernels = C.kernel_times(fn)
                    row[f"{name}_kernel_ms"] = sum(kernels.values())
                    row[f"{name}_top_kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6])
                row["gluon_backward_ran"] = [name for name in ("_dq_ws", "_dkdv_ws")
                                             if name in row["gluon_key_bias_top_kernels_ms"]]
                for name in ("skipping", "gluon_key_bias"):
                    row[f"{name}_kernel_speedup"] = row["all_tiles_kernel_ms"] / row[f"{name}_kernel_ms"]
                    row[f"sdpa_over_{name}_kernels"] = row["sdpa_bf16_dense_mask_kernel_ms"] / row[f"{name}_kernel_ms"]
                doc["rows"].append(row)
                C.save(doc, path)  # each row: a run cut short keeps its rows
                del q, k, v, dout, grads, mask
    print(f"{'D':>4s} {'N':>6s} {'causal':>6s} {'mask':>6s} {'vis':>5s}  kernel ms: all tiles / skipping / Gluon"
          f" / SDPA-dense-mask  SDPA over skipping, Gluon  Gluon ran  grad diff: skipping (max), Gluon (rel-L2)")
    for r in doc["rows"]:
        print(f"{r['d']:4d} {r['n']:6d} {str(r['causal']):>6s} {r['mask']:>6s} {r['visible_fraction']:5.2f}  "
              f"{r['all_tiles_kernel_ms']:7.3f} / {r['skipping_kernel_ms']:7.3f} / {r['gluon_key_bias_kernel_ms']:7.3f}"
              f" / {r['sdpa_bf16_dense_mask_kernel_ms']:7.3f}  {r['sdpa_over_skipping_kernels']:.2f}, "
              f"{r['sdpa_over_gluon_key_bias_kernels']:.2f}  {'+'.join(r['gluon_backward_ran']) or 'none'}  "
              f"{r['skipping_grad_max_abs_diff']:.1e}, {r['gluon_key_bias_grad_rel_l2']:.1e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="*", default=[2048, 4096, 8192], help="sequence lengths")
    ap.add_argument("--compile", action="store_true", help="the attention (and the peer) compiled by Inductor")
    args = ap.parse_args()
    main(args.ns, args.compile)
