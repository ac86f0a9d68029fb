"""Why does torch's cuDNN SDPA backward measure 1.5 rel-L2 in bench_training.py?

    python benchmarks/lab/probe_cudnn_backward.py [--out FILE]

The same gradients (dQ, dK, dV against float32 math-backend autograd, the worst of the
three) under variations of what bench_training.py does, one at a time: dO's strides
(contiguous BHND against the output's own strides), a second backward through a
retained graph, batch 1, non-causal, and our op's call of the same cuDNN backward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as Fn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rel_l2(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def case(b, h, n, d, causal, dout_layout, twice):
    torch.manual_seed(n + d)
    leaves = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    ref_in = [t.detach().float().requires_grad_() for t in leaves]
    with sdpa_kernel(SDPBackend.MATH):
        Fn.scaled_dot_product_attention(*ref_in, is_causal=causal).backward(dout.float())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = Fn.scaled_dot_product_attention(*leaves, is_causal=causal)
    if dout_layout == "like-out":
        dout = torch.empty_strided(out.shape, out.stride(), device="cuda", dtype=out.dtype).copy_(dout)
    out.backward(dout, retain_graph=twice)
    if twice:
        for t in leaves:
            t.grad = None
        out.backward(dout)
    errs = {name: rel_l2(t.grad, r.grad) for name, t, r in zip("qkv", leaves, ref_in)}
    with sdpa_kernel(SDPBackend.MATH):
        out_ref = Fn.scaled_dot_product_attention(*ref_in, is_causal=causal)
    return dict(b=b, h=h, n=n, d=d, causal=causal, dout_layout=dout_layout, twice=twice,
                out_stride=list(out.stride()), out_rel_l2=rel_l2(out, out_ref), **{f"d{k}": v for k, v in errs.items()})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    cases = [(4, 16, 4096, 128, True, "contiguous", False), (4, 16, 4096, 128, True, "like-out", False),
             (4, 16, 4096, 128, True, "contiguous", True), (1, 16, 4096, 128, True, "contiguous", False),
             (4, 16, 4096, 128, False, "contiguous", False), (2, 16, 8192, 128, True, "contiguous", False),
             (8, 16, 2048, 128, True, "contiguous", False), (8, 32, 2048, 64, True, "contiguous", False),
             (1, 8, 1024, 128, True, "contiguous", False)]
    for c in cases:
        try:
            row = case(*c)
        except Exception as err:  # recorded; the probe goes on
            row = dict(case=list(c), error=f"{type(err).__name__}: {err}"[:300])
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               cudnn=torch.backends.cudnn.version(), rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
