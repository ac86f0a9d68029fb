"""Forward attention on Hopper: our low-precision kernel against BF16 and FP8 peers.

    python benchmarks/bench_attention.py [--ns 512 1024 ...] [--ds 64 128] [--training]

(``--training [--non-causal]``: forward + backward, see bench_training.py.)

FlashAttention-3's grid: B * N = 16384 tokens, H * D = 2048, D in {64, 128},
N in {512 .. 32k}, causal off and on.  Rows, all timed in the same run with
triton.testing.do_bench medians:
  - ours, P mode direct / exp / fp4: the kernel that fp4attn::fwd runs (the Gluon kernel
    in its scope, else the Triton one) alone on quantized operands, and "+quant": the
    fp4attn::quantize op (what the backend runs) plus the kernel; "ours-direct-triton" and
    "ours-exp-gluon": the kernel the op does not pick for that mode, on the same operands
    (Direct-P against exp within each kernel structure);
  - torch SDPA BF16 on the cuDNN and flash backends, FlashAttention-4 (flash_attn.cute)
    BF16, cuDNN FP8 (cudnn frontend sdpa_fp8, plain cast, FP8 out), SageAttention 1
    (``sageattention``, INT8 Q/K); a peer whose package is missing is recorded as "not
    installed".
Accuracy: rel-L2 and cosine of each output against float32 SDPA on the same inputs.
FLOPs 4 B H N^2 D, half when causal.  Writes benchmarks/results/forward_h200.json
and .png (TFLOP/s and speedup over FA4 vs N, per D and causal).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor import kernels  # noqa: E402
from fp4_inductor import ops as _ops  # noqa: E402,F401  (registers torch.ops.fp4attn)
from fp4_inductor.kernels.gluon import attention_fwd as G  # noqa: E402
from fp4_inductor.kernels.triton import attention_fwd as A  # noqa: E402

MODES = ("direct", "exp", "fp4")
NOT_INSTALLED = C.NOT_INSTALLED


# ------------------------------------------------------------------ ours


def ours(mode, with_quant, kernel=None):
    def setup(q, k, v, causal):
        b, h, n, d = q.shape
        sm_scale = 1.0 / math.sqrt(d)
        fmt = "fp4" if mode == "fp4" else "fp8"
        quant = functools.partial(torch.ops.fp4attn.quantize, fmt=fmt)
        ops = quant(q, k, v, sm_scale)
        outputs = C.empty_outputs(b, h, n, d, dtype=q.dtype)
        launch = {"triton": A.attention_forward, "gluon": G.attention_forward}.get(kernel) or \
            kernels.forward_kernel(q, mode)

        def run_kernel(t):
            launch(*t, None, causal, mode, *outputs)
            return outputs[0]

        if with_quant:
            return lambda: run_kernel(quant(q, k, v, sm_scale))
        return lambda: run_kernel(ops)

    return setup


# ------------------------------------------------------------------ peers


def sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def setup(q, k, v, causal):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        run()
        return run

    return setup


def fa4(q, k, v, causal):
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return NOT_INSTALLED
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # FA4 takes [B, N, H, D]

    def run():
        with torch.inference_mode():
            o = flash_attn_func(qt, kt, vt, causal=causal)
        o = o[0] if isinstance(o, tuple) else o
        return o.transpose(1, 2)

    run()
    return run


def cudnn_fp8(q, k, v, causal):
    """cuDNN's FP8 SDPA (frontend graph), inputs plainly cast to E4M3, unit descales,
    FP8 output: the configuration of the peer numbers in ANCHORS."""
    try:
        import cudnn
    except ImportError:
        return NOT_INSTALLED
    b, h, n, d = q.shape
    q8, k8, v8 = (t.to(F.E4M3).contiguous() for t in (q, k, v))
    o8 = torch.empty(b, n, h, d, dtype=F.E4M3, device=q.device).transpose(1, 2)  # [B, N, H, D] storage
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    tq, tk, tv = (g.tensor(name=nm, dim=list(t.shape), stride=list(t.stride()), data_type=cudnn.data_type.FP8_E4M3)
                  for nm, t in (("Q", q8), ("K", k8), ("V", v8)))
    one = torch.ones(1, 1, 1, 1, device=q.device)
    scales = [g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT) for _ in range(6)]
    o, _, amax_s, amax_o = g.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=scales[0], descale_k=scales[1],
                                      descale_v=scales[2], descale_s=scales[3], scale_s=scales[4],
                                      scale_o=scales[5], is_inference=True, attn_scale=1.0 / math.sqrt(d),
                                      use_causal_mask=causal, name="sdpa_fp8")
    amax_s_t, amax_o_t = (torch.empty(1, 1, 1, 1, device=q.device) for _ in range(2))
    o.set_output(True).set_dim(list(o8.shape)).set_stride(list(o8.stride()))
    for amax in (amax_s, amax_o):  # cuDNN wants float32 amax outputs on sm_90
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    pack = {tq: q8, tk: k8, tv: v8, o: o8, amax_s: amax_s_t, amax_o: amax_o_t}
    pack.update({s: one for s in scales})
    ws = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=q.device)

    def run():
        g.execute(pack, ws)
        return o8

    run()
    return run


def sage(q, k, v, causal):
    """SageAttention 1 (the ``sageattention`` 1.0.6 wheel, pure Triton): INT8 Q/K with K's
    mean subtracted, FP16 P·V; the drop-in diffusion users pick."""
    try:
        from sageattention import sageattn
    except ImportError:
        return NOT_INSTALLED

    def run():
        return sageattn(q, k, v, tensor_layout="HND", is_causal=causal, smooth_k=True)

    run()
    return run


def methods():
    rows = {}
    for mode in MODES:
        rows[f"ours-{mode}"] = ours(mode, with_quant=False)
        rows[f"ours-{mode}+quant"] = ours(mode, with_quant=True)
    rows["ours-direct-triton"] = ours("direct", with_quant=False, kernel="triton")
    rows["ours-exp-gluon"] = ours("exp", with_quant=False, kernel="gluon")  # the ablation in one structure
    rows["sdpa-cudnn-bf16"] = sdpa("CUDNN_ATTENTION")
    rows["sdpa-flash-bf16"] = sdpa("FLASH_ATTENTION")
    rows["fa4-bf16"] = fa4
    rows["cudnn-fp8"] = cudnn_fp8
    rows["sage-int8"] = sage
    return rows


# ------------------------------------------------------------------ driver


def accuracy(out, ref):
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm()).item(), torch.nn.functional.cosine_similarity(
        o.flatten(), r.flatten(), dim=0).item()


def precompile_ours(ns, ds):
    """One compile per kernel variant (the lengths do not specialise it)."""
    specs = {(d, mode, causal, A.tuned_config(d, causal, n)) for d in ds for n in ns for causal in (False, True)
             for mode in MODES}
    return C.precompile([(1024, d, mode, causal, 0, cfg, (), A.PERM_P) for d, mode, causal, cfg in sorted(
        specs, key=str)])


def run(ns, ds, out_json, out_png):
    import triton
    from tqdm import tqdm

    env = C.environment()
    print(env, flush=True)
    t0 = time.time()
    errors = precompile_ours(sorted(set(ns)), ds)
    bad = {k: v for k, v in errors.items() if v}
    print(f"precompiled our kernels in {time.time() - t0:.0f}s ({len(bad)} failed)", flush=True)
    table = methods()
    results = []
    doc = {"env": env, "flops": "4*B*H*N^2*D, half for causal",
           "timer": "triton.testing.do_bench(warmup=10 ms, rep=40 ms), median",
           "grid": "B*N=16384, H*D=2048", "options": A.OPTIONS,
           "configs": {f"d{d}_causal{int(c)}_n{n}": A.tuned_config(d, c, n) for n in ns for d in ds
                       for c in (False, True)},
           "precompile_errors": {str(k): v for k, v in bad.items()},
           "results": results}
    items = [(d, n, causal) for d in ds for n in ns for causal in (False, True)]
    bar = tqdm(total=len(items) * len(table), desc="forward", unit="run", mininterval=10)
    signal.signal(signal.SIGTERM, C.stop)
    try:
        _measure(items, table, results, bar, doc, out_json, triton)
    except KeyboardInterrupt:
        print("\nstopped early: writing what was measured", flush=True)
    bar.close()
    C.save(doc, out_json)
    plot(doc, out_png)
    print_table(doc)


def _measure(items, table, results, bar, doc, out_json, triton):
    for d, n, causal in items:
        b, h = C.fa3_shape(n, d)
        torch.manual_seed(n * 131 + d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        flops = C.attention_flops(b, h, n, n, d, causal)
        for name, setup in table.items():
            row = dict(method=name, d=d, n=n, b=b, h=h, causal=causal)
            try:
                fn = setup(q, k, v, causal)
                if fn == NOT_INSTALLED:
                    row["status"] = NOT_INSTALLED
                else:
                    row["rel_l2"], row["cos"] = accuracy(fn().float(), ref)
                    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                    row.update(status="ok", ms=ms, tflops=flops / ms * 1e-9)
            except Exception as err:  # recorded in the table; the run goes on
                row["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
                traceback.print_exc(limit=2)
            results.append(row)
            bar.update(1)
        del q, k, v, ref
        torch.cuda.empty_cache()
        C.save(doc, out_json)  # after every shape, so a cut-short run still leaves its numbers


def print_table(doc):
    res = doc["results"]
    names = list(dict.fromkeys(r["method"] for r in res))
    keys = sorted({(r["d"], r["causal"]) for r in res})
    ns = sorted({r["n"] for r in res})
    for d, causal in keys:
        print(f"\nTFLOP/s, D={d}, causal={causal}   (rel-L2 vs fp32 SDPA at the largest N)")
        print(f"{'method':20s}" + "".join(f"{n:>8d}" for n in ns) + "   rel-L2")
        for name in names:
            cells, acc = [], ""
            for n in ns:
                r = next((x for x in res if x["method"] == name and x["d"] == d and x["causal"] == causal
                          and x["n"] == n), None)
                if r is None or r.get("status") != "ok":
                    cells.append("     n/i" if r and r.get("status") == NOT_INSTALLED else "     err")
                else:
                    cells.append(f"{r['tflops']:8.0f}")
                    acc = f"{r['rel_l2']:.4f}"
            print(f"{name:20s}" + "".join(cells) + f"   {acc}")


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in doc["results"] if r.get("status") == "ok"]
    keys = sorted({(r["d"], r["causal"]) for r in doc["results"]})
    fig, axes = plt.subplots(2, len(keys), figsize=(4.5 * len(keys), 8), squeeze=False)
    names = list(dict.fromkeys(r["method"] for r in doc["results"]))
    for j, (d, causal) in enumerate(keys):
        sub = [r for r in res if r["d"] == d and r["causal"] == causal]
        base = {r["n"]: r["tflops"] for r in sub if r["method"] == "fa4-bf16"}
        base_name = "FA4 BF16"
        if not base:
            base = {r["n"]: r["tflops"] for r in sub if r["method"] == "sdpa-cudnn-bf16"}
            base_name = "cuDNN BF16"
        for name in names:
            pts = sorted((r["n"], r["tflops"]) for r in sub if r["method"] == name)
            if not pts:
                continue
            style = "-" if name.startswith("ours") and "+quant" not in name else "--" if name.startswith("ours") else ":"
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=name)
            sp = [(n, t / base[n]) for n, t in pts if n in base and name.startswith("ours")]
            if sp:
                axes[1][j].plot([p[0] for p in sp], [p[1] for p in sp], style, marker="o", ms=3, label=name)
        axes[0][j].set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
        axes[0][j].set_ylabel("TFLOP/s")
        axes[1][j].set_ylabel(f"speedup over {base_name}")
        axes[1][j].axhline(1.0, color="gray", lw=0.8)
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length N")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    env = doc["env"]
    fig.suptitle(f"Forward attention, {env.get('device', '?')}, torch {env['torch']}, triton {env['triton']}, "
                 f"{env['date'][:10]}  (B*N=16384, H*D=2048)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--ds", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--training", action="store_true", help="forward+backward and backward alone, causal")
    ap.add_argument("--non-causal", action="store_true", help="with --training: no mask instead of causal")
    ap.add_argument("--methods", nargs="*", default=None, help="with --training: only these rows (names as in "
                                                                "bench_training.methods)")
    ap.add_argument("--out", default=None, help="path stem (default benchmarks/results/forward_h200, "
                                                 "training_h200 or training_noncausal_h200)")
    args = ap.parse_args()
    if args.non_causal and not args.training:
        ap.error("--non-causal is for --training (the forward grid times both)")
    stem = "training_noncausal_h200" if args.non_causal else "training_h200" if args.training else "forward_h200"
    out = args.out or os.path.join(C.RESULTS, stem)
    if args.training:
        import bench_training

        bench_training.run(args.ns, args.ds, not args.non_causal, out + ".json", out + ".png", args.methods)
    else:
        run(args.ns, args.ds, out + ".json", out + ".png")


if __name__ == "__main__":
    main()
