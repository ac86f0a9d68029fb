"""bench_training's cuDNN BF16 row measured 1.52 rel-L2 when it ran after the rows of our
op, 0.0025 alone (H100, 2026-12-06).  Which row does it, and does anything the rows share
(the leaves, dO, the float32 reference gradients) change while ours run?

    python benchmarks/lab/probe_bench_corruption.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_training  # noqa: E402
import common as C  # noqa: E402


def main():
    n, d = 4096, 128
    b, h = C.fa3_shape(n, d)
    table = bench_training.methods(True)
    for before in ("ours-direct", "ours-direct-compiled", "ours-hybrid-cudnn"):
        torch.manual_seed(n * 131 + d)
        leaves = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        ref_in = [t.detach().float().requires_grad_() for t in leaves]
        torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True).backward(dout.float())
        ref = [t.grad for t in ref_in]
        shared = {"q": leaves[0], "k": leaves[1], "v": leaves[2], "dout": dout, "ref_dq": ref[0]}
        copies = {name: t.detach().cpu().clone() for name, t in shared.items()}
        fwd_bwd, bwd, grads = table[before](leaves, dout)
        triton.testing.do_bench(fwd_bwd, warmup=10, rep=40, grad_to_none=leaves)
        if bwd is not None:  # the retained graph's backward, again and again, as bench_training times it
            triton.testing.do_bench(bwd, warmup=10, rep=40, grad_to_none=leaves)
        torch.cuda.synchronize()
        changed = [name for name, t in shared.items() if not torch.equal(t.detach().cpu(), copies[name])]
        _, _, cudnn_grads = table["sdpa-cudnn-bf16"](leaves, dout)
        err = max(bench_training._rel_l2(g, r) for g, r in zip(cudnn_grads, ref))
        fresh = [t.detach().clone().requires_grad_() for t in leaves]
        _, _, fresh_grads = table["sdpa-cudnn-bf16"](fresh, dout)
        err_fresh = max(bench_training._rel_l2(g, r) for g, r in zip(fresh_grads, ref))
        print(f"after {before}: changed {changed or 'nothing'}; cuDNN row {err:.4f}, on fresh leaf copies {err_fresh:.4f}",
              flush=True)
        del leaves, dout, ref_in, ref, fwd_bwd, bwd, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
