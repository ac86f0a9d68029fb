"""Does a call of torch's cuDNN SDPA backward through our op (the hybrid path's cuDNN
backward) change what torch's own cuDNN SDPA backward computes later in the process, or
the other way round?  Each sequence runs in a fresh interpreter; each step prints its
gradients' worst rel-L2 against float32 math-backend autograd.

    python benchmarks/lab/probe_cudnn_order.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STEP = r'''
import json, math, sys, torch
import torch.nn.functional as Fn
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, sys.argv[1])
from fp4_inductor.kernels import bf16_backward

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

def inputs(seed, b=4, h=16, n=4096, d=128):
    torch.manual_seed(seed)
    leaves = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    ref = [t.float().requires_grad_() for t in leaves]
    with sdpa_kernel(SDPBackend.MATH):
        out = Fn.scaled_dot_product_attention(*ref, is_causal=True)
    out.backward(dout.float())
    return leaves, dout, out.detach(), [t.grad for t in ref]

def torch_cudnn(seed):
    leaves, dout, _, ref = inputs(seed)
    leaves = [t.requires_grad_() for t in leaves]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        Fn.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
    return max(rel(t.grad, r) for t, r in zip(leaves, ref))

def ours(seed, philox):
    leaves, dout, out32, ref = inputs(seed)
    q, k, v = leaves
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    del s
    out = out32.to(torch.bfloat16)
    if philox:  # what torch's own forward hands its backward
        fwd = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, scale=scale)
        seeds = fwd[6:8]
        print("philox", [(t.dtype, tuple(t.shape), t.device.type) for t in seeds], "lse", tuple(fwd[1].shape), fwd[1].stride(), file=sys.stderr)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), *seeds, None, None, None, q.shape[2], k.shape[2], 0.0, True, scale=scale)
    else:
        dq, dk, dv = bf16_backward._cudnn(dout, q, k, v, out, lse, None, scale, True, 0, 0)
    return max(rel(g, r) for g, r in zip((dq, dk, dv), ref))

results = []
for step in sys.argv[2].split(","):
    err = torch_cudnn(len(results)) if step == "torch" else ours(len(results), step == "ours-philox")
    results.append((step, err))
print(json.dumps(results))
'''

SEQUENCES = ["torch,ours", "ours,torch", "ours,ours", "torch,torch", "ours-philox,torch", "torch,ours-philox"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for seq in SEQUENCES:
        done = subprocess.run([sys.executable, "-c", STEP, str(ROOT), seq], capture_output=True, text=True,
                              timeout=300, env=os.environ)
        row = {"sequence": seq, "steps": json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
               else None, "stderr": done.stderr[-800:]}
        print(row, flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
