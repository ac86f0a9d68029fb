"""The quantization op's kernels: launch-shape variants, and the previous version, timed in
one run (H200).

    python benchmarks/lab/explore_quantize.py [--baseline MODULE]

Each variant sets ``kernels/triton/quantize.py``'s launch-shape variables; ``--baseline``
names a module with the previous version's ``quantize_inputs`` (two passes over K and V),
timed on the same inputs.  Per shape: device microseconds of each kernel (profiler) and
their sum, the CUDA-graph replay, and the DRAM bytes the design must move at 4.26 TB/s
(Q and K read once, V twice, codes written) next to the one-pass floor.  First, every
variant's codes are checked against ``formats.quantize_inputs`` on the CPU.  Writes
benchmarks/results/lab/explore_quantize_h200.json.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
from tqdm import tqdm
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor.kernels.triton import quantize as Q  # noqa: E402

SHAPES = [(4, 16, 16, 4096, 128), (8, 16, 16, 2048, 128), (4, 32, 32, 4096, 64), (1, 32, 8, 4096, 128)]
DEFAULT = dict(_Q_ROWS=32, _K_TILE=16, _V_ROWS=64, _WARPS=4, _STATS_TILE=32, _STATS_WARPS=4, _STATS_STAGES=1)
VARIANTS = {  # the V-per-block branch's kernel gained 1.5x from K/V tiles of 32 and Q rows of 64
    "shipped": {},
    "8 warps": dict(_WARPS=8),
    "K tile 32": dict(_K_TILE=32),
    "Q rows 64": dict(_Q_ROWS=64),
    "K tile 32, Q rows 64": dict(_K_TILE=32, _Q_ROWS=64),
    "K tile 64": dict(_K_TILE=64),
}


def configure(settings):
    for name, value in dict(DEFAULT, **settings).items():
        setattr(Q, name, value)


def inputs(b, h, hkv, n, d):
    # [B, N, H, D] storage, as a projection's view gives; K with a channel offset to smooth.
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16) * 2 + 1).transpose(1, 2)
    v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return q, k, v


def check(launch) -> str:
    """Codes against formats on the CPU: Q and V bit-identical, K within one step."""
    torch.manual_seed(1)
    q, k, v = inputs(2, 4, 2, 1000, 128)
    got = launch(q, k, v, 0.088)
    want = F.quantize_inputs(q.cpu(), k.cpu(), v.cpu(), 0.088, "fp8")
    for name, g, w in zip(("q8", "k8", "v_t", "q_scale", "k_scale", "v_scale"), got, want):
        g, w = g.cpu(), w
        if g.dtype == F.E4M3:
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        if name == "k8":
            bad = (g.int() - w.int()).abs()
            if bad.max() > 1 or (bad > 0).float().mean() > 1e-4:
                return f"k8 off by {bad.max().item()}"
        elif name == "k_scale":
            if not torch.allclose(g, w, rtol=1e-6, atol=0):
                return "k_scale"
        elif not torch.equal(g, w):
            return name
    return "ok"


def measure(launch, shape) -> dict:
    torch.manual_seed(0)
    q, k, v = inputs(*shape)
    run = lambda: launch(q, k, v, shape[-1] ** -0.5)  # noqa: E731
    run()
    kernels = {name: round(1e3 * ms, 1) for name, ms in C.kernel_times(run, calls=10).items() if ms > 0}
    return {"kernels_us": kernels, "device_us": round(sum(kernels.values()), 1),
            "graph_replay_us": round(1e3 * do_bench_cudagraph(run), 1)}


def floors(b, h, hkv, n, d) -> dict:
    q_elems, kv_elems = b * h * n * d, b * hkv * n * d
    return {"floor_us": round(C.quantize_floor_us(q_elems, kv_elems), 1),
            "one_pass_floor_us": round(C.quantize_floor_us(q_elems, kv_elems, v_reads=1), 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="module with the previous quantize_inputs")
    ap.add_argument("--out", default=os.path.join(C.RESULTS, "lab", "explore_quantize_h200.json"))
    args = ap.parse_args()
    launches = {name: (lambda s=settings: configure(s), Q.quantize_inputs) for name, settings in VARIANTS.items()}
    if args.baseline:
        launches["previous version"] = (lambda: None, importlib.import_module(args.baseline).quantize_inputs)
    doc = {"environment": C.environment(), "shapes": {}, "checks": {}}
    bar = tqdm(total=len(launches) * (len(SHAPES) + 1))
    for name, (setup, launch) in launches.items():
        setup()
        doc["checks"][name] = check(launch) if name != "previous version" else "(other K mean)"
        bar.update()
        for shape in SHAPES:
            key = "b{}h{}kv{}n{}d{}".format(*shape)
            doc["shapes"].setdefault(key, floors(*shape))[name] = measure(launch, shape)
            bar.update()
    bar.close()
    configure({})
    C.save(doc, args.out)
    print(f"{'variant':28s} {'check':8s} " + " ".join(f"{k:>24s}" for k in doc["shapes"]))
    for name in launches:
        cells = [f"{doc['shapes'][k][name]['device_us']:.0f} / {doc['shapes'][k][name]['graph_replay_us']:.0f}"
                 for k in doc["shapes"]]
        print(f"{name:28s} {doc['checks'][name][:8]:8s} " + " ".join(f"{c:>24s}" for c in cells))
    print(f"{'floor (one pass)':37s} " + " ".join(
        f"{v['floor_us']:.0f} ({v['one_pass_floor_us']:.0f})".rjust(24) for v in doc["shapes"].values()))
    print("(device us / CUDA-graph replay us per call)")


if __name__ == "__main__":
    main()
