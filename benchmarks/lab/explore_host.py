"""Host time against device time of one causal training step at short lengths.

    python benchmarks/explore_host.py [--ns 512 1024 4096] [--ds 128]

Per shape of the FA3 grid (B * N = 16384, H * D = 2048), eager ``lowp_attention``, the
same under ``torch.compile`` (as bench_training.py's rows) and under
``torch.compile(mode="reduce-overhead")`` (CUDA graphs: the launches replayed, no Python a
kernel), one forward + backward a step:
  - host ms a step: 20 steps queued back to back without a sync, then the sync's wait
    counted apart (where the kernels outrun the host, this is the host's time a step);
  - the kernels' device ms a step, and launches a step, from the profiler, and each
    kernel's ms a step;
  - the profiler's table of CPU self time (our custom ops' own Python is their self time).
Each step starts from ``.grad = None``, as ``bench_training.py``'s do.
A Python profile of the step would mislead: the backward runs on autograd's device thread,
which cProfile does not follow; ``explore_launcher_host.py --cuda --profile`` profiles the
backward launcher on one thread.
Where host time exceeds kernel time the step waits on Python, not on the GPU.  Writes
explore_host.json into --out-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
import common as C  # noqa: E402

from fp4_inductor.attention import lowp_attention  # noqa: E402

STEPS = 20
torch._dynamo.config.recompile_limit = 64


def attend(q, k, v):
    return lowp_attention(q, k, v, is_causal=True)


def measure(step):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    host = (time.perf_counter() - t0) / STEPS
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / STEPS
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    launches = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    cpu_self = sorted(((e.key, e.self_cpu_time_total / 5e3) for e in prof.key_averages()), key=lambda kv: -kv[1])
    per_kernel = C.kernel_ms(prof, 5)
    return {"host_ms": host * 1e3, "wall_ms": wall * 1e3, "kernels_ms": sum(per_kernel.values()),
            "launches": launches / 5, "cpu_self_ms": [(k[:80], round(t, 4)) for k, t in cpu_self[:15]],
            "kernel_ms": sorted(((k[:80], round(t, 4)) for k, t in per_kernel.items()), key=lambda kv: -kv[1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--ds", type=int, nargs="+", default=[128])
    ap.add_argument("--out-dir", default=os.path.join(C.RESULTS, "lab"))
    args = ap.parse_args()
    result = {"env": C.environment(), "rows": []}
    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    graphed = torch.compile(attend, fullgraph=True, dynamic=False, mode="reduce-overhead")
    for d in args.ds:
        for n in args.ns:
            b, h = C.fa3_shape(n, d)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            for mode, fn in (("eager", attend), ("compiled", compiled), ("cudagraphs", graphed)):
                def step(fn=fn, graphs=mode == "cudagraphs"):
                    if graphs:  # a new training step: the last step's graph outputs may be reused
                        torch.compiler.cudagraph_mark_step_begin()
                    for t in (q, k, v):  # as optimizer.zero_grad() does: no add into .grad
                        t.grad = None
                    fn(q, k, v).backward(dout)

                row = {"d": d, "n": n, "mode": mode, **measure(step)}
                result["rows"].append(row)
                print(f"D={d} N={n} {mode:8s}: host {row['host_ms']:.3f} ms a step, kernels {row['kernels_ms']:.3f} "
                      f"ms, {row['launches']:.0f} launches; CPU self: "
                      + ", ".join(f"{k[:28]} {t:.3f}" for k, t in row["cpu_self_ms"][:4]), flush=True)
                print("  kernels, ms a step:", ", ".join(f"{k[:40]} {t:.3f}" for k, t in row["kernel_ms"][:8]))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "explore_host.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
