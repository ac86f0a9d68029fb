"""Turn benchmark JSONs into the policy's cost table for that GPU.

    python benchmarks/cost_table.py benchmarks/results/forward_h200.json [benchmarks/results/training_h200.json]

Writes fp4_inductor/tables/<gpu>.json: TFLOP/s per path, head dim, causality and mode,
at each measured N.  Forward: low precision is charged with its quantization pass
("+quant" rows: the conservative case where Inductor finds no producer to fuse it
into); BF16 is the faster of torch SDPA's cuDNN and flash backends, so the policy never
assumes a slower fallback than the user would get.  Training (causal fwd+bwd, from
``bench_attention.py --training``): our Triton backward against the same SDPA backends.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp4_inductor import policy  # noqa: E402
PATHS = {"fp8": ["ours-direct+quant"], "fp4": ["ours-fp4+quant"], "bf16": ["sdpa-cudnn-bf16", "sdpa-flash-bf16"]}
TRAINING_PATHS = {"fp8": ["ours-direct-compiled"], "bf16": ["sdpa-cudnn-bf16", "sdpa-flash-bf16"]}
# Fixed cost of the low-precision path's extra kernels (quantization of Q, K, V and K's
# mean) at shapes too small to fill the GPU: about five launches of ~3 us.
LAUNCH_US = 15.0


def _add_rates(rates, rows, paths, mode):
    for row in rows:
        if row.get("status") != "ok" or row.get("pass") == "bwd":  # training: the fwd+bwd rows
            continue
        for name, methods in paths.items():
            if row["method"] in methods:
                key = f"d{row['d']}/{'causal' if row['causal'] else 'full'}/{mode}"
                best = rates[name][key].get(str(row["n"]), 0.0)
                rates[name][key][str(row["n"])] = round(max(best, row["tflops"]), 1)


def main(forward: str, training: str | None = None) -> None:
    docs = {"fwd": json.loads(Path(forward).read_text())}
    if training:
        docs["train"] = json.loads(Path(training).read_text())
    rates: dict = defaultdict(lambda: defaultdict(dict))
    for mode, doc in docs.items():
        _add_rates(rates, doc["results"], PATHS if mode == "fwd" else TRAINING_PATHS, mode)
    gpu = docs["fwd"]["env"]["device"]
    sources = [forward] + ([training] if training else [])
    table = {
        "gpu": gpu,
        "source": "; ".join(f"{Path(p).name} ({d['env'].get('date', '')}, torch {d['env'].get('torch', '')})"
                            for p, d in zip(sources, docs.values())),
        "launch_us": LAUNCH_US,
        "tflops": rates,
    }
    out = policy.table_path(gpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
