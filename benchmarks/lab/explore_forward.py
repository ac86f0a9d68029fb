"""Check and time forward-kernel variants in one run (the measurements behind the
defaults in kernels/triton/attention_fwd.py; see docs/perf-notes/2026-11.md, "Versions:
prediction → measurement").

    python benchmarks/explore_forward.py [--quick]
    python benchmarks/explore_forward.py --kernel-only [--ns 4096 16384] [--ds 128 64]

1. accuracy of the kernel against reference.attention_forward (CPU, same quantized
   inputs): rel-L2, max |err| / max |ref|, max LSE difference, per P mode and shape;
2. end-to-end ``lowp_attention`` against float32 SDPA on Gaussian inputs;
3. TFLOP/s of kernel variants (tile config x switches) on FA3-grid shapes.
Writes explore_forward.json into --out-dir (default benchmarks/results) and prints tables.
``--kernel-only`` times only what the ``fp4attn::fwd`` op runs (``kernels.forward_kernel``:
the Gluon kernel where it applies), P mode direct, causal and not, on the FA3 grid (min of
three medians, with each kernel's device time from a profiler): the quick A/B of one source
tree against another (``ab_kernels.py --forward``; explore_forward_kernels.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor import kernels  # noqa: E402
from fp4_inductor import reference as R  # noqa: E402
from fp4_inductor.attention import lowp_attention  # noqa: E402
from fp4_inductor.kernels.triton import attention_fwd as A  # noqa: E402


def accuracy_cases():
    # (B, H, Hkv, Nq, Nk, D, causal, bias kind)
    return [
        (1, 4, 2, 1023, 1023, 128, False, None),
        (1, 4, 1, 799, 4224, 64, False, "keypad"),
        (1, 2, 2, 4224, 4224, 128, True, None),
        (1, 4, 4, 203, 113, 64, True, "keypad"),
        (2, 2, 1, 1, 799, 128, False, None),
    ]


# Kernel switches, spelt out so the variants mean the same whatever the defaults are.
BASE = (("CVT_I2F", False), ("PV_SPLIT", False))
I2F = (("CVT_I2F", True), ("PV_SPLIT", False))
PV = (("CVT_I2F", False), ("PV_SPLIT", True))
BOTH = (("CVT_I2F", True), ("PV_SPLIT", True))
ACC_VARIANTS = {"default": BOTH, "magic_i2f+pv_split": PV, "i2f": I2F, "base": BASE}  # name: launcher options


def precompile_accuracy(modes):
    specs = []
    for (b, h, hkv, nq, nk, d, causal, bias_kind), mode in itertools.product(accuracy_cases(), modes):
        for opts in ACC_VARIANTS.values():
            specs.append((nq, d, mode, causal, 1 if bias_kind else 0, None, opts, True, ("nk", nk),
                          ("out_dtype", "float32")))
    t0 = time.time()
    errors = C.precompile(specs)
    print(f"precompiled {len(specs)} accuracy variants in {time.time() - t0:.0f}s; "
          f"{sum(e is not None for e in errors.values())} failed", flush=True)


def run_accuracy(modes):
    precompile_accuracy(modes)
    rows = []
    for (b, h, hkv, nq, nk, d, causal, bias_kind), mode in itertools.product(accuracy_cases(), modes):
        (q, k, v), (q8, k8, vt, qs, ks, vs) = C.quantized_inputs(b, h, hkv, nq, nk, d, mode, device="cpu",
                                                                  dtype=torch.float32)
        bias = None
        if bias_kind == "keypad":
            keep = torch.rand(b, 1, 1, nk) > 0.25
            keep[..., 0] = True
            bias = torch.where(keep, 0.0, -1e30)
        t0 = time.time()
        ref_o, ref_l, _ = R.attention_forward(q8, k8, vt, qs, ks, vs, bias, causal, mode, torch.float32)
        t_ref = time.time() - t0
        dev = [t.cuda() for t in (q8, k8, vt, qs, ks, vs)]
        res = {}
        for name, opts in ACC_VARIANTS.items():
            out, lse, row_ref = C.empty_outputs(b, h, nq, d, dtype=torch.float32)
            A.attention_forward(*dev, None if bias is None else bias.cuda(), causal, mode, out, lse, row_ref,
                                options=dict(opts))
            out, lse = out.cpu(), lse.cpu()
            diff = out.double() - ref_o.double()
            res[name] = dict(
                rel_l2=(diff.norm() / ref_o.double().norm()).item(),
                max_rel=(diff.abs().max() / ref_o.abs().max()).item(),
                lse_max=(lse - ref_l).abs().max().item(),
                nan=bool(out.isnan().any() or lse.isnan().any()),
                out=out, lse=lse)
        base_out, base_lse = res["default"].pop("out"), res["default"].pop("lse")
        for name, r in res.items():
            if name != "default":
                o, l = r.pop("out"), r.pop("lse")
                r["identical_to_default"] = bool(torch.equal(o, base_out) and torch.equal(l, base_lse))
            else:
                r["identical_to_default"] = True
        row = dict(mode=mode, shape=[b, h, hkv, nq, nk, d], causal=causal, bias=bias_kind, ref_seconds=round(t_ref, 2),
                   variants=res)
        rows.append(row)
        cells = " | ".join(f"{n}: l2={r['rel_l2']:.1e} max={r['max_rel']:.1e} lse={r['lse_max']:.1e}"
                           f"{' same' if r['identical_to_default'] and n != 'default' else ''}{' NaN' if r['nan'] else ''}"
                           for n, r in res.items())
        print(f"acc {mode:6s} {row['shape']} causal={int(causal)} bias={bias_kind}: {cells}", flush=True)
    return rows


def run_reference_on_cuda():
    """Does reference.attention_forward run on CUDA tensors (the ops' fallback path)?"""
    _, t = C.quantized_inputs(1, 1, 1, 8, 8, 64, "direct")
    try:
        R.attention_forward(*t, None, False, "direct", torch.float32)
        return "ok"
    except Exception as err:
        return f"{type(err).__name__}: {str(err)[:200]}"


def run_end_to_end():
    rows = []
    for (b, h, n, d), fmt_mode in itertools.product([(2, 8, 1024, 128), (1, 16, 4096, 64)],
                                                    [("fp8", "direct"), ("fp8", "exp"), ("fp4", "fp4")]):
        fmt, mode = fmt_mode
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        bf16 = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out = lowp_attention(q, k, v, fmt=fmt, p_mode=mode)
        r = (out.double() - ref.double()).norm() / ref.double().norm()
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0)
        rb = (bf16.double() - ref.double()).norm() / ref.double().norm()
        rows.append(dict(shape=[b, h, n, d], fmt=fmt, mode=mode, rel_l2=r.item(), cos=cos.item(), bf16_rel_l2=rb.item()))
        print(f"e2e {fmt}/{mode} {[b, h, n, d]}: rel_l2={r.item():.4f} cos={cos.item():.6f} (bf16 sdpa {rb.item():.4f})",
              flush=True)
    return rows


def timing_variants(quick):
    i2f, pv, both = I2F, PV, BOTH
    big, small, reg = (128, 8, 3, None), (64, 4, 2, 168), (64, 4, 3, 168)
    v = []
    # (N, D, mode, causal, bias_mode, config, options, perm)
    for n, cfg, opts in itertools.product((4096, 16384), (big, small, (128, 8, 2, None)), (BASE, i2f, pv, both)):
        v.append((n, 128, "direct", False, 0, cfg, opts, True))
    for n, cfg, opts in itertools.product((4096, 16384), (big, small), (BASE, i2f)):
        v.append((n, 128, "exp", False, 0, cfg, opts, True))
        v.append((n, 128, "direct", True, 0, cfg, opts, True))
    for cfg, opts in itertools.product((big, reg, (64, 4, 2, None)), (BASE, i2f)):
        v.append((4096, 64, "direct", False, 0, cfg, opts, True))
        v.append((4096, 64, "direct", True, 0, cfg, opts, True))
        v.append((4096, 64, "exp", False, 0, cfg, opts, True))
    for cfg in (big, small):
        v.append((4096, 128, "fp4", False, 0, cfg, i2f, True))
    if quick:
        v = v[:6]
    return v


def run_timing(variants):
    import triton

    t0 = time.time()
    errors = C.precompile(variants)
    print(f"precompiled {len(variants)} variants in {time.time() - t0:.0f}s; "
          f"{sum(e is not None for e in errors.values())} failed", flush=True)
    rows = []
    for spec in variants:
        n, d, mode, causal, bias_mode, cfg, opts, perm = spec
        row = dict(n=n, d=d, mode=mode, causal=causal, config=list(cfg), options=dict(opts), perm=perm)
        if errors.get(spec):
            row["error"] = errors[spec]
            rows.append(row)
            print(f"time {row}: {errors[spec]}", flush=True)
            continue
        b, h = C.fa3_shape(n, d)
        _, t = C.quantized_inputs(b, h, h, n, n, d, mode)
        outputs = C.empty_outputs(b, h, n, d)
        fn = lambda: A.attention_forward(*t, None, causal, mode, *outputs, config=cfg, options=dict(opts),  # noqa: E731
                                         perm_p=perm)
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        row["ms"] = ms
        row["tflops"] = C.attention_flops(b, h, n, n, d, causal) / ms * 1e-9
        rows.append(row)
        print(f"time N={n} D={d} {mode:6s} causal={int(causal)} cfg={cfg} opts={dict(opts)} perm={int(perm)}: "
              f"{row['tflops']:.0f} TFLOP/s", flush=True)
    return rows


def run_kernel_only(ns, ds):
    """What ``fp4attn::fwd`` runs, per shape: ms (min of three do_bench medians) and each
    kernel's device ms."""
    from triton.testing import do_bench

    rows = []
    for d in ds:
        for n in ns:
            for causal in (False, True):
                b, h = C.fa3_shape(n, d)
                _, t = C.quantized_inputs(b, h, h, n, n, d, "direct")
                outputs = C.empty_outputs(b, h, n, d)
                launch = lambda: kernels.forward_kernel(t[0], "direct")(*t, None, causal, "direct", *outputs)  # noqa: E731
                ms = min(do_bench(launch, return_mode="median") for _ in range(3))
                per_kernel = C.kernel_times(launch)
                rows.append({"d": d, "n": n, "causal": causal, "what": "forward_kernel", "ms": ms,
                             "tflops": C.attention_flops(b, h, n, n, d, causal) / ms * 1e-9,
                             "per_kernel_ms": per_kernel})
                print(f"D={d} N={n} causal={int(causal)}: forward_kernel {ms:.3f} ms; "
                      + ", ".join(f"{name[:24]} {v:.3f}" for name, v in per_kernel.items()), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[], help="accuracy e2e timing")
    ap.add_argument("--kernel-only", action="store_true", help="only time what the fwd op runs")
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 16384], help="with --kernel-only")
    ap.add_argument("--ds", type=int, nargs="+", default=[128, 64], help="with --kernel-only")
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    if args.kernel_only:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "explore_forward_kernels.json"), "w") as f:
            json.dump({"env": C.environment(), "timings": run_kernel_only(args.ns, args.ds)}, f, indent=1)
        return
    results = {"env": C.environment()}
    print(results["env"], flush=True)
    results["reference_on_cuda"] = run_reference_on_cuda()
    print("reference.attention_forward on CUDA:", results["reference_on_cuda"], flush=True)
    if "timing" not in args.skip:
        results["timing"] = run_timing(timing_variants(args.quick))
    if "accuracy" not in args.skip:
        results["accuracy"] = run_accuracy(F.P_MODES)
    if "e2e" not in args.skip:
        results["end_to_end"] = run_end_to_end()
    out_dir = args.out_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "explore_forward.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n== best per (N, D, mode, causal) ==")
    best = {}
    for r in results.get("timing", []):
        key = (r["n"], r["d"], r["mode"], r["causal"])
        if "tflops" in r and r["tflops"] > best.get(key, {}).get("tflops", 0):
            best[key] = r
    for key, r in sorted(best.items()):
        print(f"{key}: {r['tflops']:.0f} TFLOP/s cfg={r['config']} opts={r['options']} perm={r['perm']}")


if __name__ == "__main__":
    main()
