"""What quantizing Q, K and V costs, and the compiled path end to end.

    python benchmarks/quant_overhead.py

1. Quantization alone at the forward benchmark's shape (B N = 16k tokens, H D = 2048):
   the fp4attn::quantize op (two Triton launches) against the same formats code compiled
   by Inductor (the design before the op), against the byte floor (Q and K read once, V
   twice, 8-bit codes written).  Device time summed over the kernels (profiler) and the
   CUDA-graph replay time (no CPU overhead).
2. A Llama-3.1-8B-shaped attention block (width 4096, 32 query and 8 KV heads of 128;
   QKV projection, optional rotary embedding, causal SDPA with GQA, output projection;
   one 4k-token sequence) compiled with Inductor's default backend vs backend fp4attn (policy always),
   with the op and with the formats code traced into the graph for Inductor to fuse; plain
   and as a CUDA graph (Inductor's cudagraphs, what mode="reduce-overhead" sets).  Output
   cosine against the default.
Writes benchmarks/results/quant_overhead_<device>.json.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
from pathlib import Path
from unittest import mock

import torch
from triton.testing import do_bench, do_bench_cudagraph

import fp4_inductor
from fp4_inductor import formats as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def kernel_us(fn) -> dict[str, float]:
    """Device time per kernel name for one call, in microseconds: where the time goes."""
    return {name: round(1e3 * ms, 1) for name, ms in C.kernel_times(fn, calls=1).items() if ms > 0}


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, n: int, rotary: bool):
        super().__init__()
        self.heads, self.kv_heads, self.rotary = heads, kv_heads, rotary
        d = width // heads
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * d, bias=False)
        self.out = torch.nn.Linear(width, width, bias=False)
        angle = torch.arange(n)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        self.register_buffer("cos", torch.cat((angle, angle), -1).cos())
        self.register_buffer("sin", torch.cat((angle, angle), -1).sin())

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).view(b, n, self.heads + 2 * self.kv_heads, d).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        if self.rotary:
            q, k = rope(q, self.cos, self.sin), rope(k, self.cos, self.sin)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


def main() -> None:
    results = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
               "torch": torch.__version__, "quantize_us": {}, "kernels_us": {}, "block_ms": {}}
    b, h, n, d = 4, 16, 4096, 128
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    sm_scale = 1 / math.sqrt(d)
    results["quantize_us"]["byte_floor"] = C.quantize_floor_us(q.numel(), k.numel())
    variants = {
        "op": lambda: torch.ops.fp4attn.quantize(q, k, v, sm_scale, "fp8"),
        "inductor": torch.compile(lambda: F.quantize_inputs(q, k, v, sm_scale, "fp8")),
    }
    for name, fn in variants.items():
        fn()
        times = kernel_us(fn)
        results["kernels_us"][f"quantize {name}"] = times
        results["quantize_us"][f"{name} device"] = round(sum(times.values()), 1)
        results["quantize_us"][f"{name} graph replay"] = round(1e3 * do_bench_cudagraph(fn), 1)

    width, heads, kv_heads, b = 4096, 32, 8, 1  # Llama-3.1-8B, one 4k sequence
    x = torch.randn(b, n, width, device="cuda", dtype=torch.bfloat16)
    ours = fp4_inductor.backend(policy="always")  # works without the package's entry point
    runs = [("inductor", "inductor", False, False), ("fp4attn", ours, False, False),
            ("fp4attn aten-quant", ours, False, True), ("inductor+cudagraph", "inductor", True, False),
            ("fp4attn+cudagraph", ours, True, False)]
    cosines = {}
    for rotary in (False, True):
        block = Block(width, heads, kv_heads, n, rotary).cuda().to(torch.bfloat16).eval()
        outputs = {}
        for name, backend, cudagraphs, aten_quant in runs:
            label = f"{'rope ' if rotary else ''}{name}"
            torch._dynamo.reset()
            patch = mock.patch.object(torch.ops.fp4attn, "quantize", F.quantize_inputs) if aten_quant else contextlib.nullcontext()
            # No compile caches: with the op patched out the graph's cache key is unchanged.
            config = {"triton.cudagraphs": cudagraphs, "fx_graph_cache": False}
            with torch.no_grad(), patch, torch._inductor.config.patch(config), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                fn = torch.compile(block, backend=backend)
                for _ in range(3):
                    outputs[name] = fn(x).clone()
                results["block_ms"][label] = round(do_bench(lambda: fn(x), return_mode="median"), 4)
                results["kernels_us"][f"block {label}"] = kernel_us(lambda: fn(x))
        ref = outputs["inductor"].float().flatten()
        for name, out in outputs.items():
            cosines[f"{'rope ' if rotary else ''}{name}"] = torch.nn.functional.cosine_similarity(
                out.float().flatten(), ref, dim=0).item()
    results["cosine_vs_inductor"] = cosines
    out = Path(__file__).parent / "results" / f"quant_overhead_{results['device'].lower().replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps({k: results[k] for k in ("quantize_us", "block_ms", "cosine_vs_inductor")}, indent=1))


if __name__ == "__main__":
    main()
