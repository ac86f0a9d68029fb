"""Does the auto policy pick the faster path?  60 attention shapes on this GPU.

    python benchmarks/policy_grid.py

Shapes: N 256 .. 32k, B H 8 .. 512, D 64 and 128, causal on and off, inference and
training (forward + backward), and training with key padding (HF's ``attention_mask``:
a quarter of the keys of every other sequence padded).  Each shape runs both paths in
the same process: BF16 (torch SDPA, what a fallback site runs: with padding, on the dense
mask that HF builds) and fp8 (``lowp_attention``: the quantization op, the forward
kernel and, in training, the backward kernels; with padding, the key-padding vector).
Times are the median of three alternating rounds of triton do_bench medians.  The policy's pick is the cost
model's (``policy.cost_model_decision``) over the shipped table for this GPU, which was
measured by bench_attention.py, not by this script.  Targets (issue 5): the faster path
for >= 95 % of shapes, never more than 3 % slower than it.
Writes benchmarks/results/policy_grid_<device>.json and .png (the decision map).
``--rescore JSON``: judge a grid timed earlier with the table shipped now (after the
table is rebuilt), without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp4_inductor import policy  # noqa: E402
from fp4_inductor.attention import lowp_attention  # noqa: E402

# (B, H, N): B H from 8 to 512, N from 256 to 32k; causal alternates along the list.
SIZES = [(1, 8, 256), (4, 16, 256), (32, 16, 256), (1, 8, 1024), (8, 8, 1024), (16, 32, 1024),
         (1, 8, 2048), (4, 16, 2048), (1, 8, 4096), (2, 16, 4096), (8, 16, 4096), (1, 8, 8192),
         (2, 16, 8192), (1, 8, 16384), (1, 8, 32768)]
TOLERANCE = 0.03
ROUNDS = 3


def grid():
    for training, padded in ((False, False), (True, False), (True, True)):
        for d in (64, 128):
            for i, (b, h, n) in enumerate(SIZES):
                yield dict(b=b, h=h, n=n, d=d, causal=i % 2 == 1, training=training, padded=padded)


def key_padding(b: int, n: int, device) -> torch.Tensor:
    """[B, N] keys kept: every other sequence (the first, with B = 1) loses its last quarter."""
    keep = torch.ones(b, n, dtype=torch.bool, device=device)
    keep[::2, n - n // 4:] = False
    return keep


def measure(shape) -> dict[str, float]:
    from triton.testing import do_bench  # only timing needs Triton (--rescore does not)

    b, h, n, d, causal, training = (shape[k] for k in ("b", "h", "n", "d", "causal", "training"))
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=training) for _ in range(3))
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    if shape.get("padded"):
        keep = key_padding(b, n, q.device)
        dense = keep[:, None, None, :] & (torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if causal else True)
        paths = {"bf16": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                 "fp8": lambda: lowp_attention(q, k, v, is_causal=causal, key_padding=keep)}
    else:
        paths = {"bf16": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                 "fp8": lambda: lowp_attention(q, k, v, is_causal=causal)}
    runs, outputs = {}, {}
    for name, fn in paths.items():
        if training:
            def step(fn=fn):
                fn().backward(dout)
            runs[name] = step
        else:
            def run(fn=fn):
                with torch.no_grad():
                    return fn()
            runs[name] = run
        with torch.no_grad():
            outputs[name] = fn().float()
    # Alternating rounds: clock drift during the run lands on both paths alike.
    samples = {name: [] for name in paths}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            samples[name].append(do_bench(run, warmup=10, rep=40, grad_to_none=[q, k, v], return_mode="median"))
    times = {name: statistics.median(ts) for name, ts in samples.items()}
    cosine = torch.nn.functional.cosine_similarity(outputs["fp8"].flatten(), outputs["bf16"].flatten(), dim=0).item()
    return {"bf16_ms": times["bf16"], "fp8_ms": times["fp8"], "cosine": cosine}


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("inference", "training", "training, key padding")
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 11), sharex=True, sharey=True)
    for row in doc["rows"]:
        ax = axes[int(row["training"]) + int(bool(row.get("padded")))][0 if row["d"] == 64 else 1]
        faster = "fp8" if row["fp8_ms"] < row["bf16_ms"] else "bf16"
        color = {"fp8": "tab:orange", "bf16": "tab:blue"}[row["pick"]]
        marker = "^" if row["causal"] else "o"
        ax.scatter(row["n"], row["b"] * row["h"], c=color, marker=marker, s=90,
                   edgecolors="red" if row["pick"] != faster else "black", linewidths=2 if row["pick"] != faster else 0.5)
        ax.annotate(f"{row['bf16_ms'] / row['fp8_ms']:.2f}", (row["n"], row["b"] * row["h"]), fontsize=7,
                    xytext=(5, 5), textcoords="offset points")
    for i, mode in enumerate(modes):
        for j, d in enumerate((64, 128)):
            ax = axes[i][j]
            ax.set(xscale="log", yscale="log", title=f"{mode}, D={d}", xlabel="N", ylabel="B*H")
            ax.grid(True, alpha=0.3)
    s = doc["summary"]
    rescored = doc["env"].get("rescored")
    when = doc["env"]["date"][:16] + (f", picks rescored {rescored[:16]}" if rescored else "")
    fig.suptitle(f"auto policy on {doc['env']['device']} ({when}): colour = pick (orange fp8, blue BF16), "
                 f"red edge = slower pick; label = BF16/fp8 time\n{s['right']}/{s['shapes']} faster path picked, "
                 f"worst pick {100 * s['worst_regret']:.1f} % slower; circle = full, triangle = causal", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def judge(row, model, gpu):
    """The cost model's pick for a timed grid row, and how much slower it is than the
    faster path (the timings do not depend on the table, so a row can be judged again)."""
    mask = ("causal+padding" if row["causal"] else "padding") if row.get("padded") else \
        ("causal" if row["causal"] else "none")
    site = policy.SiteShape(row["b"], row["h"], row["h"], row["n"], row["n"], row["d"], row["causal"], row["training"],
                            mask=mask)
    decision = policy.cost_model_decision(site, "fp8", model, gpu)
    row.update(pick=decision.path, reason=decision.reason, predicted_speedup=decision.predicted_speedup)
    row["regret"] = row[f"{row['pick']}_ms"] / min(row["bf16_ms"], row["fp8_ms"]) - 1


def summarize(rows):
    right = sum(r["regret"] == 0 for r in rows)
    return {"shapes": len(rows), "right": right, "within_3pct": sum(r["regret"] <= TOLERANCE for r in rows),
            "worst_regret": max(r["regret"] for r in rows),
            "fp8_faster": sum(r["fp8_ms"] < r["bf16_ms"] for r in rows),
            "target_met": right >= 0.95 * len(rows) and all(r["regret"] <= TOLERANCE for r in rows)}


def measure_grid():
    from tqdm import tqdm

    gpu = torch.cuda.get_device_name()
    model = policy.cost_model(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for shape in tqdm(list(grid()), desc="policy grid", unit="shape"):
        row = {**shape, **measure(shape)}
        judge(row, model, gpu)
        rows.append(row)
        torch.cuda.empty_cache()
    env = {"device": gpu, "date": _now(), "torch": torch.__version__, "table": model.source if model else None}
    return {"env": env, "summary": summarize(rows), "rows": rows}


def rescore(path):
    """A grid timed earlier, judged by the table now shipped for its GPU (no GPU needed)."""
    with open(path) as f:
        doc = json.load(f)
    gpu = doc["env"]["device"]
    model = policy.table_for(gpu)
    for row in doc["rows"]:
        judge(row, model, gpu)
    doc["env"].update(rescored=_now(), table=model.source if model else None)
    doc["summary"] = summarize(doc["rows"])
    return doc


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "policy_grid_h200"))
    ap.add_argument("--rescore", metavar="JSON",
                    help="judge a grid timed earlier with the current table instead of timing one")
    args = ap.parse_args()
    doc = rescore(args.rescore) if args.rescore else measure_grid()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, args.out + ".png")
    rows = doc["rows"]
    print(f"{'mode':9} {'d':>3} {'B':>3} {'H':>3} {'N':>6} {'c':1} {'bf16 ms':>8} {'fp8 ms':>8} {'x':>5} {'pick':>4} {'regret':>6}")
    for r in rows:
        mode = ("train+pad" if r.get("padded") else "train") if r["training"] else "fwd"
        print(f"{mode:9} {r['d']:3} {r['b']:3} {r['h']:3} {r['n']:6} {'c' if r['causal'] else 'f'} "
              f"{r['bf16_ms']:8.3f} {r['fp8_ms']:8.3f} {r['bf16_ms'] / r['fp8_ms']:5.2f} {r['pick']:>4} {100 * r['regret']:5.1f}%")
    print(json.dumps(doc["summary"]))


if __name__ == "__main__":
    main()
