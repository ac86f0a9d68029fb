"""Where the backward's time goes, and backward-kernel variants, in one run.

    python benchmarks/explore_backward.py [--ns 4096] [--ds 128 64] [--ncu | --kernel-only]

1. a profiler table of one eager causal forward + backward of ``lowp_attention`` on the
   FA3 grid (B * N = 16384, H * D = 2048): device time per kernel, so the backward's
   preparation (dO quantization, delta, E4M3 views of Q and K, token-major copies) is
   seen next to the two backward kernels;
2. the preparation alone and the Triton backward kernels alone, per (num_warps,
   num_stages) configuration, then what ``kernels.backward_kernel`` runs (the Gluon
   kernels where they apply), as do_bench medians.
``--kernel-only`` runs step 2's last timing alone (min of three medians) with each
kernel's device time from a profiler: the quick A/B of one source tree against another
(written to explore_backward_kernels.json).
Writes explore_backward.json into --out-dir (default benchmarks/results).  ``--ncu`` only
runs what ``backward_kernel`` runs, twice per shape (compile, then the launch to profile),
for a hardware-counter profiler, e.g.
``ncu --clock-control none --set full -k regex:"_ws|_bwd" --launch-skip 2 --launch-count 2
python benchmarks/explore_backward.py --ncu --ds 128``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402

from fp4_inductor import kernels, quantized  # noqa: E402
from fp4_inductor.attention import lowp_attention  # noqa: E402
from fp4_inductor.kernels.triton import attention_bwd as AB  # noqa: E402

CONFIGS = [{"dkdv": (8, 1), "dq": (8, 1)}, {"dkdv": (16, 1), "dq": (16, 1)}, {"dkdv": (16, 2), "dq": (16, 2)},
           {"dkdv": (8, 2), "dq": (8, 2)}]


def profile_step(b, h, n, d):
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    step = lambda: lowp_attention(q, k, v, is_causal=True).backward(dout)  # noqa: E731
    step()
    torch.cuda.synchronize()
    rows = sorted(C.kernel_times(step, calls=1).items(), key=lambda kv: -kv[1])
    return [{"kernel": name[:90], "us": round(ms * 1e3, 1)} for name, ms in rows]


def bwd_operands(b, h, n, d, device="cuda"):
    """The preparation (dO quantization and the rest, as a callable) and ``attention_backward``'s
    positional arguments for a causal direct-P call on Gaussian inputs."""
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    out, lse, row_ref, operands = quantized.quantized_forward(q, k, v, None, d ** -0.5, True, "fp8", "direct")
    dout = torch.randn_like(q)
    prep = lambda: quantized.grad_operands(dout, out, lse, row_ref, operands, "direct")  # noqa: E731
    grad = prep()
    grads = [torch.empty(b, h, n, d, device=device, dtype=torch.bfloat16) for _ in range(3)]
    q8, k8, v_t, q_scale, k_scale, v_scale = operands.flat()
    args = (*grad.do, grad.delta, q8, k8, v_t, q_scale, k_scale, v_scale, *grad.qe, *grad.ke, None,
            row_ref, True, "direct", *grads)
    return prep, args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[4096])
    ap.add_argument("--ds", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--ncu", action="store_true", help="only launch the backward kernels, twice per shape")
    mode.add_argument("--kernel-only", action="store_true", help="only time what backward_kernel runs")
    args = ap.parse_args()
    result = {"env": C.environment(), "profile": {}, "timings": []}
    for d in args.ds:
        for n in args.ns:
            b, h = C.fa3_shape(n, d)
            prep, bargs = bwd_operands(b, h, n, d)
            launch = lambda: kernels.backward_kernel(bargs[3], "direct")(*bargs)  # noqa: E731
            if args.ncu:
                for _ in range(2):
                    launch()
                torch.cuda.synchronize()
                continue
            flops = 2.5 * C.attention_flops(b, h, n, n, d, True)
            if args.kernel_only:
                ms = min(do_bench(launch, return_mode="median") for _ in range(3))
                per_kernel = C.kernel_times(launch)
                result["timings"].append({"d": d, "n": n, "what": "backward_kernel", "ms": ms,
                                          "tflops": flops / ms * 1e-9, "per_kernel_ms": per_kernel})
                print(f"D={d} N={n}: backward_kernel {ms:.3f} ms; "
                      + ", ".join(f"{name[:24]} {t:.3f}" for name, t in per_kernel.items()), flush=True)
                continue
            result["profile"][f"d{d}_n{n}"] = table = profile_step(b, h, n, d)
            print(f"\nD={d} N={n} B={b} H={h}: device time per kernel (us), one forward + backward")
            for row in table[:14]:
                print(f"  {row['us']:9.1f}  {row['kernel']}")
            prep_ms = do_bench(prep, return_mode="median")
            result["timings"].append({"d": d, "n": n, "what": "prep", "ms": prep_ms})
            print(f"  prep alone: {prep_ms:.3f} ms")
            for cfg in CONFIGS:
                try:
                    ms = do_bench(lambda: AB.attention_backward(*bargs, config=cfg), return_mode="median")
                except Exception as err:  # a config that does not compile or fit: record why
                    result["timings"].append({"d": d, "n": n, "config": cfg, "error": repr(err)[:200]})
                    print(f"  kernels {cfg}: {err!r:.120}")
                    continue
                result["timings"].append({"d": d, "n": n, "config": cfg, "ms": ms, "tflops": flops / ms * 1e-9})
                print(f"  kernels {cfg}: {ms:.3f} ms, {flops / ms * 1e-9:.0f} TFLOP/s (2.5x forward FLOPs)",
                      flush=True)
            ms = do_bench(launch, return_mode="median")
            result["timings"].append({"d": d, "n": n, "what": "backward_kernel", "ms": ms, "tflops": flops / ms * 1e-9})
            print(f"  backward_kernel (Gluon where it applies): {ms:.3f} ms, {flops / ms * 1e-9:.0f} TFLOP/s", flush=True)
    if args.ncu:
        return
    os.makedirs(args.out_dir, exist_ok=True)
    name = "explore_backward_kernels.json" if args.kernel_only else "explore_backward.json"
    with open(os.path.join(args.out_dir, name), "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
