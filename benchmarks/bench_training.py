"""Attention in training on Hopper: forward + backward and backward alone.

    python benchmarks/bench_attention.py --training [--non-causal] [--ns ...] [--ds 64 128]

FlashAttention-3's grid (B * N = 16384, H * D = 2048), causal (``--non-causal``: without
a mask, which gives the policy's table its non-causal training rates).  Rows, timed in
the same run (triton do_bench medians):
  - ours: ``lowp_attention`` with the backward kernels, the quantization of Q/K/V and dO
    included, eagerly ("ours-direct": dO's quantization and
    the backward's other preparation run as separate aten kernels) and under
    ``torch.compile`` ("ours-direct-compiled": Inductor fuses that preparation, as in a
    model compiled with ``backend="fp4attn"``), and compiled with ``mode="reduce-overhead"``
    ("ours-direct-graphs": the step replayed as CUDA graphs, without the host's Python;
    forward + backward only);
  - ours with the one-kernel FP8 backward (``FP4ATTN_FUSED_BACKWARD=1``,
    ``kernels.gluon.attention_bwd_fused``): eagerly ("ours-fused"), compiled
    ("ours-fused-compiled") and as CUDA graphs ("ours-fused-graphs");
  - ours, hybrid: the FP8 forward with a BF16 backward (``backward="bf16"``, the policy's
    ``fp8+bf16bwd``), eagerly, with FlashAttention-4's backward ("ours-hybrid-fa4") and
    with torch's cuDNN one ("ours-hybrid-cudnn"), as ``kernels.bf16_backward`` runs them;
  - torch SDPA BF16 on the cuDNN and flash backends, FlashAttention-4 BF16 (flash_attn.cute);
  - cuDNN FP8 (cudnn frontend sdpa_fp8 with stats + sdpa_fp8_backward): E4M3 Q/K/V/O/dO
    cast plainly, E4M3 gradients, and the usual delayed scaling (a first step with unit
    scales measures the amaxes of S, O, dP and the gradients; the timed steps use scales
    from them).  cuDNN has no FP8 backward at D = 64 on sm_90: that row records the error.
Each timed step starts with the leaves' ``.grad`` set to None, as ``optimizer.zero_grad()``
does, so autograd stores the gradients instead of adding them into the last step's (cuDNN
FP8 writes its own buffers).  FLOPs: 2.5x the forward's for the backward, 3.5x for both
(FA3's convention).
Accuracy: rel-L2 of dQ, dK, dV against float32 autograd on the same inputs (the worst
of the three is the row's).  Writes benchmarks/results/training_h200.json and .png.
"""

from __future__ import annotations

import os
import signal
import traceback

import torch

import common as C

from fp4_inductor import formats as F
from fp4_inductor.attention import lowp_attention
from fp4_inductor.kernels import bf16_backward

PASSES = {"fwd+bwd": 3.5, "bwd": 2.5}
# The compiled row specialises on each shape of the grid (14 by default).
torch._dynamo.config.recompile_limit = 64


def _autograd(attend, cuda_graphs=False):
    """A method given as a differentiable ``attend(q, k, v)``: returns its setup.
    ``cuda_graphs``: ``attend`` was compiled with ``mode="reduce-overhead"``; each step
    starts a new graph step, the gradients come from a replayed step, and the backward is
    not timed alone (it would re-run a step whose outputs the next replay overwrites)."""

    def setup(leaves, dout):
        def drop_grads():  # as optimizer.zero_grad() does: autograd stores, no add into .grad
            for t in leaves:
                t.grad = None

        def fwd_bwd():
            drop_grads()
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            attend(*leaves).backward(dout)

        if cuda_graphs:
            for _ in range(3):  # warm-up, recording, then a replay
                fwd_bwd()
            return fwd_bwd, None, [t.grad.float() for t in leaves]

        drop_grads()
        out = attend(*leaves)
        out.backward(dout, retain_graph=True)
        grads = [t.grad.float() for t in leaves]

        def bwd():
            drop_grads()
            out.backward(dout, retain_graph=True)

        return fwd_bwd, bwd, grads

    return setup


def _sdpa(backend_name, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def attend(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return _autograd(attend)


def _fa4(causal):
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return C.NOT_INSTALLED

    def attend(q, k, v):  # FA4 takes [B, N, H, D]
        o = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal)
        return (o[0] if isinstance(o, tuple) else o).transpose(1, 2)

    return _autograd(attend)


E4M3_MAX = 448.0
_FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
_BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
# amax outputs, and the scale (and descale) each one sets for the timed steps.
_AMAX_SETS = {"s": ("scale_s", "descale_s"), "o": ("scale_o", "descale_o"), "dP": ("scale_dP", "descale_dP"),
              "dQ": ("scale_dQ", None), "dK": ("scale_dK", None), "dV": ("scale_dV", None)}


def _cudnn_fp8(causal):
    try:
        import cudnn
    except ImportError:
        return C.NOT_INSTALLED
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT

    def new_graph():
        return cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32)

    def declare(graph, name, t, dtype):
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dtype)

    def output(node, t, dtype):
        node.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride())).set_data_type(dtype)

    def build(graph):
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()

    def setup(leaves, dout):
        b, h, n, d = leaves[0].shape
        dev = dout.device
        data = {name: t.detach().to(F.E4M3) for name, t in zip(("q", "k", "v", "dO"), (*leaves, dout))}
        data["o"] = torch.empty_like(data["q"])
        stats = torch.empty(b, h, n, 1, device=dev)
        grads8 = {name: torch.empty_like(data["q"]) for name in ("dQ", "dK", "dV")}
        scalars = {name: torch.ones(1, 1, 1, 1, device=dev) for name in {*_FWD_SCALARS, *_BWD_SCALARS}}
        amax = {name: torch.zeros(1, 1, 1, 1, device=dev) for name in _AMAX_SETS}

        fwd = new_graph()
        t = {name: declare(fwd, name, data[name], e4m3) for name in ("q", "k", "v")}
        fs = {name: declare(fwd, name, scalars[name], f32) for name in _FWD_SCALARS}
        o, st, amax_s, amax_o = fwd.sdpa_fp8(**t, **fs, is_inference=False, attn_scale=d**-0.5,
                                             use_causal_mask=causal)
        output(o, data["o"], e4m3)
        output(st, stats, f32)
        output(amax_s, amax["s"], f32)
        output(amax_o, amax["o"], f32)
        build(fwd)
        fwd_pack = {**{t[k]: data[k] for k in t}, **{fs[k]: scalars[k] for k in fs}, o: data["o"], st: stats,
                    amax_s: amax["s"], amax_o: amax["o"]}

        bwd = new_graph()
        t = {name: declare(bwd, name, data[name], e4m3) for name in ("q", "k", "v", "o", "dO")}
        bs = {name: declare(bwd, name, scalars[name], f32) for name in _BWD_SCALARS}
        t_stats = declare(bwd, "stats", stats, f32)
        outs = bwd.sdpa_fp8_backward(**t, stats=t_stats, **bs, attn_scale=d**-0.5, use_causal_mask=causal)
        dq, dk, dv, *amaxes = outs[:7]  # gradients, then the amaxes of dQ, dK, dV and dP
        for node, name in zip((dq, dk, dv), grads8):
            output(node, grads8[name], e4m3)
        for node, name in zip(amaxes, ("dQ", "dK", "dV", "dP")):
            output(node, amax[name], f32)
        build(bwd)
        bwd_pack = {**{t[k]: data[k] for k in t}, **{bs[k]: scalars[k] for k in bs}, t_stats: stats,
                    dq: grads8["dQ"], dk: grads8["dK"], dv: grads8["dV"],
                    **{node: amax[name] for node, name in zip(amaxes, ("dQ", "dK", "dV", "dP"))}}
        workspace = torch.empty(max(fwd.get_workspace_size(), bwd.get_workspace_size()), dtype=torch.uint8,
                                device=dev)

        def fwd_bwd():
            fwd.execute(fwd_pack, workspace)
            bwd.execute(bwd_pack, workspace)

        fwd_bwd()  # unit scales: measures the amaxes
        torch.cuda.synchronize()
        for name, (scale, descale) in _AMAX_SETS.items():
            scalars[scale].copy_(E4M3_MAX / amax[name].clamp_min(1e-30))
            if descale:
                scalars[descale].copy_(1.0 / scalars[scale])
        fwd_bwd()
        grads = [grads8[name].float() / scalars[f"scale_{name}"] for name in ("dQ", "dK", "dV")]
        return fwd_bwd, lambda: bwd.execute(bwd_pack, workspace), grads

    return setup


def _hybrid(causal, only):
    """Our FP8 forward with the BF16 backward ``only`` (one of ``kernels.bf16_backward``'s,
    through FP4ATTN_BF16_BACKWARD), or C.NOT_INSTALLED."""
    if only == "fa4" and not bf16_backward.has_fa4():
        return C.NOT_INSTALLED

    def attend(q, k, v):
        return lowp_attention(q, k, v, is_causal=causal, backward="bf16")

    return _under_env("FP4ATTN_BF16_BACKWARD", only, _autograd(attend))


def _under_env(var, value, setup):
    """``setup`` whose setup and timed calls all run with the environment's ``var`` set to
    ``value`` (the backward kernels read their switches at call time)."""

    def setup_under(leaves, dout):
        fwd_bwd, bwd, grads = _with_env(var, value, setup, leaves, dout)
        under = [None if fn is None else (lambda fn=fn: _with_env(var, value, fn)) for fn in (fwd_bwd, bwd)]
        return (*under, grads)

    return setup_under


def _with_env(var, value, fn, *args):
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old


def methods(causal):
    def attend(q, k, v):
        return lowp_attention(q, k, v, is_causal=causal)

    def attend_fused_backward(q, k, v):
        # Its own code object: Dynamo caches compiled code, and with it the CUDA graphs that
        # captured one backward kernel or the other, per code object and mode.
        return attend(q, k, v)

    def compiled(fn, mode="default"):
        return _autograd(torch.compile(fn, fullgraph=True, dynamic=False, mode=mode),
                         cuda_graphs=mode == "reduce-overhead")

    def fused(setup):  # kernels.fused_backward_enabled
        return _under_env("FP4ATTN_FUSED_BACKWARD", "1", setup)

    direct = _autograd(attend)
    return {
        "ours-fused": fused(direct),
        "ours-fused-compiled": fused(compiled(attend_fused_backward)),
        "ours-fused-graphs": fused(compiled(attend_fused_backward, "reduce-overhead")),
        "ours-hybrid-fa4": _hybrid(causal, "fa4"),
        "ours-hybrid-cudnn": _hybrid(causal, "cudnn"),
        "ours-direct": direct,
        "ours-direct-compiled": compiled(attend),
        "ours-direct-graphs": compiled(attend, "reduce-overhead"),
        "sdpa-cudnn-bf16": _sdpa("CUDNN_ATTENTION", causal),
        "sdpa-flash-bf16": _sdpa("FLASH_ATTENTION", causal),
        "fa4-bf16": _fa4(causal),
        "cudnn-fp8": _cudnn_fp8(causal),
    }


def _rel_l2(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def run(ns, ds, causal, out_json, out_png, only=None):
    import triton
    from tqdm import tqdm

    doc = {"env": C.environment(), "flops": "4*B*H*N^2*D (half when causal) x 3.5 fwd+bwd, x 2.5 bwd",
           "timer": "triton.testing.do_bench(warmup=10 ms, rep=40 ms), median",
           "grid": f"B*N=16384, H*D=2048, {'causal' if causal else 'non-causal'}", "results": []}
    table = {name: setup for name, setup in methods(causal).items() if not only or name in only}
    items = [(d, n) for d in ds for n in ns]
    bar = tqdm(total=len(items) * len(table), desc="training", unit="run", mininterval=10)
    signal.signal(signal.SIGTERM, C.stop)
    try:
        for d, n in items:
            _measure_shape(d, n, causal, table, doc, bar, triton)
            C.save(doc, out_json)
    except KeyboardInterrupt:
        print("\nstopped early: writing what was measured", flush=True)
    bar.close()
    C.save(doc, out_json)
    plot(doc, out_png)
    print_table(doc)


def _measure_shape(d, n, causal, table, doc, bar, triton):
    b, h = C.fa3_shape(n, d)
    torch.manual_seed(n * 131 + d)
    leaves = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    ref_in = [t.detach().float().requires_grad_() for t in leaves]
    torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=causal).backward(dout.float())
    ref = [t.grad for t in ref_in]
    fwd_flops = C.attention_flops(b, h, n, n, d, causal)
    for name, setup in table.items():
        rows = [dict(method=name, d=d, n=n, b=b, h=h, causal=causal, **{"pass": p}) for p in PASSES]
        try:
            if setup == C.NOT_INSTALLED:
                for row in rows:
                    row["status"] = setup
            else:
                _time_method(setup, leaves, dout, ref, fwd_flops, rows, triton)
        except Exception as err:  # recorded in the table; the run goes on
            for row in rows:
                row["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
            traceback.print_exc(limit=2)
        doc["results"].extend(rows)
        bar.update(1)
    torch.cuda.empty_cache()


def _time_method(setup, leaves, dout, ref, fwd_flops, rows, triton):
    fwd_bwd, bwd, grads = setup(leaves, dout)
    rel = max(_rel_l2(g, r) for g, r in zip(grads, ref))
    for row, fn in zip(rows, (fwd_bwd, bwd)):
        if fn is None:
            row["status"] = "not timed"
            continue
        ms = triton.testing.do_bench(fn, warmup=10, rep=40, grad_to_none=leaves, return_mode="median")
        row.update(status="ok", ms=ms, tflops=fwd_flops * PASSES[row["pass"]] / ms * 1e-9, grad_rel_l2=rel)


def _kind(doc):
    return "causal" if all(r["causal"] for r in doc["results"]) else "non-causal"


def print_table(doc):
    res = [r for r in doc["results"] if r.get("status") == "ok"]
    ns = sorted({r["n"] for r in doc["results"]})
    kind = _kind(doc)
    for d in sorted({r["d"] for r in doc["results"]}):
        for p in PASSES:
            print(f"\nTFLOP/s, {kind} {p}, D={d}   (worst of dQ/dK/dV rel-L2 vs fp32 at the largest N)")
            print(f"{'method':18s}" + "".join(f"{n:>8d}" for n in ns) + "   rel-L2")
            for name in dict.fromkeys(r["method"] for r in doc["results"]):
                cells, acc = [], ""
                for n in ns:
                    r = next((x for x in res if (x["method"], x["d"], x["n"], x["pass"]) == (name, d, n, p)), None)
                    cells.append(f"{r['tflops']:8.0f}" if r else "       -")
                    acc = f"{r['grad_rel_l2']:.4f}" if r else acc
                print(f"{name:18s}" + "".join(cells) + f"   {acc}")


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in doc["results"] if r.get("status") == "ok"]
    ds = sorted({r["d"] for r in doc["results"]})
    fig, axes = plt.subplots(1, 2 * len(ds), figsize=(4.5 * 2 * len(ds), 4), squeeze=False)
    for j, (d, p) in enumerate((d, p) for d in ds for p in PASSES):
        ax = axes[0][j]
        for name in dict.fromkeys(r["method"] for r in res):
            pts = sorted((r["n"], r["tflops"]) for r in res if (r["method"], r["d"], r["pass"]) == (name, d, p))
            ax.plot([x for x, _ in pts], [y for _, y in pts], "-" if name.startswith("ours") else ":", marker="o",
                    ms=3, label=name)
        ax.set(xscale="log", title=f"{_kind(doc)} {p}, D={d}", xlabel="sequence length N", ylabel="TFLOP/s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    env = doc["env"]
    fig.suptitle(f"Attention training, {env.get('device', '?')}, torch {env['torch']}, {env['date'][:10]} "
                 "(B*N=16384, H*D=2048)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
