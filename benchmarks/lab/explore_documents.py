"""Packed documents on the H200: the Triton forward and backward with document ids
against the same kernels under plain causal masking (every tile of the diagonal's lower
half) and against BF16 SDPA with the equivalent dense mask.

    python benchmarks/lab/explore_documents.py [--out results/lab/explore_documents_h200.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor.attention import lowp_attention  # noqa: E402
from fp4_inductor.kernels.triton import attention_fwd  # noqa: E402


def _ms(fn, rep=50):
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--docs", type=int, nargs="*", default=[1, 4, 16])
    args = ap.parse_args()
    torch.manual_seed(0)
    b, h, d, n = 1, 16, 128, args.n
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ops = F.quantize_inputs(q, k, v, 1 / math.sqrt(d), "fp8")
    out = torch.empty(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse, row_ref = (torch.empty(b, h, n, device="cuda") for _ in range(2))
    rows = []
    for docs in args.docs:
        # unequal lengths: document i has a share proportional to i + 1
        shares = torch.arange(1, docs + 1, dtype=torch.float64)
        lengths = (shares / shares.sum() * n).floor().long()
        lengths[-1] += n - lengths.sum()
        ids = torch.repeat_interleave(torch.arange(docs), lengths).cuda()[None]
        visible = float((lengths.double() * (lengths.double() + 1) / 2).sum()) / (n * n)
        fwd_docs = _ms(lambda: attention_fwd.attention_forward(*ops, None, True, "direct", out, lse, row_ref,
                                                               q_documents=ids, k_documents=ids))
        fwd_causal = _ms(lambda: attention_fwd.attention_forward(*ops, None, True, "direct", out, lse, row_ref))
        dense = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(n, n, dtype=torch.bool,
                                                                               device="cuda").tril()
        sdpa_dense = _ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(q)

        def train_docs():
            lowp_attention(qg, kg, vg, is_causal=True, q_documents=ids, k_documents=ids).backward(dout)

        def train_sdpa():
            torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, attn_mask=dense).backward(dout)

        row = dict(n=n, docs=docs, visible=visible, fwd_docs_ms=fwd_docs, fwd_causal_ms=fwd_causal,
                   sdpa_dense_fwd_ms=sdpa_dense, train_docs_ms=_ms(train_docs, 20),
                   train_sdpa_dense_ms=_ms(train_sdpa, 20))
        del dense
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "b": b, "h": h, "d": d, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
