"""What quantization costs outside the kernel, and the compiled path end to end.

    python benchmarks/quant_overhead.py

1. formats.quantize_q/k/v, together and one by one, compiled with static and with
   dynamic shapes, at the forward benchmark's shape (B N = 16k tokens, H D = 2048),
   against the ~70 us byte floor;
2. one attention block (QKV projection, causal SDPA, output projection) compiled with
   Inductor's default backend vs backend fp4attn (policy always), plain and as a CUDA
   graph (Inductor's cudagraphs, as mode="reduce-overhead" sets), with the output's
   cosine against the default.
Writes benchmarks/results/quant_overhead_<device>.json.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import torch
from triton.testing import do_bench

import fp4_inductor
from fp4_inductor import formats as F


def quantize(q, k, v, sm_scale):
    return F.quantize_q(q, sm_scale), F.quantize_k(k), F.quantize_v(v, "fp8")


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


def main() -> None:
    results = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
               "torch": torch.__version__, "quantize_ms": {}, "block_ms": {}}
    b, h, n, d = 4, 16, 4096, 128
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    floor_ms = 3 * q.numel() * 3 / 4.26e12 * 1e3  # read bf16, write 8-bit, per tensor
    sm_scale = 1 / math.sqrt(d)
    parts = {
        "all": lambda: quantize(q, k, v, sm_scale),
        "q": lambda: F.quantize_q(q, sm_scale),
        "k": lambda: F.quantize_k(k),
        "v": lambda: F.quantize_v(v, "fp8"),
    }
    for dynamic in (False, True):
        for name, part in parts.items():
            torch._dynamo.reset()
            fn = torch.compile(part, dynamic=dynamic)
            fn()
            results["quantize_ms"][f"{name} dynamic={dynamic}"] = do_bench(fn, return_mode="median")
    results["quantize_ms"]["byte_floor_all"] = floor_ms

    block = Block(h * d, h).cuda().to(torch.bfloat16).eval()
    x = torch.randn(b, n, h * d, device="cuda", dtype=torch.bfloat16)
    outputs = {}
    with torch.no_grad():
        ours = fp4_inductor.backend(policy="always")  # works without the package's entry point
        for name, backend, cudagraphs in [("inductor", "inductor", False), ("fp4attn", ours, False),
                                          ("inductor+cudagraph", "inductor", True), ("fp4attn+cudagraph", ours, True)]:
            torch._dynamo.reset()
            with torch._inductor.config.patch({"triton.cudagraphs": cudagraphs}):  # read at compile time
                fn = torch.compile(block, backend=backend)
                for _ in range(3):
                    outputs[name] = fn(x).clone()
            results["block_ms"][name] = do_bench(lambda: fn(x), return_mode="median")
    ref = outputs["inductor"].float().flatten()
    results["cosine_vs_inductor"] = {
        name: torch.nn.functional.cosine_similarity(out.float().flatten(), ref, dim=0).item() for name, out in outputs.items()
    }
    out = Path(__file__).parent / "results" / f"quant_overhead_{results['device'].lower().replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
