"""Turn benchmark JSONs into the policy's cost table for that GPU.

    python benchmarks/cost_table.py benchmarks/results/forward_h200.json \
        [benchmarks/results/training_h200.json benchmarks/results/training_noncausal_h200.json]

Writes fp4_inductor/tables/<gpu>.json: TFLOP/s per path, head dim, causality and mode,
at each measured N.  Forward: low precision is charged with its quantization pass
("+quant" rows: the conservative case where Inductor finds no producer to fuse it
into), and the kernels' rate alone is kept beside it ("-kernel"); BF16 is the faster
of torch SDPA's cuDNN and flash backends, so the policy never assumes a slower fallback
than the user would get.  Training (fwd+bwd, from ``bench_attention.py --training
[--non-causal]``): our compiled forward + backward against
the same SDPA backends.  Masked sites (``--masked``, from
``benchmarks/lab/explore_masked_sites.py``): key padding and sliding windows, keyed by
the site's mask kind; low precision is what the backend runs (quantization counted), BF16
is SDPA on the dense boolean mask, which is what such a site falls back to.  Padded
training (``--masked-training``, from ``benchmarks/lab/explore_padded_training.py
--compile``): the compiled fwd + bwd with key padding, the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp4_inductor import policy  # noqa: E402

PATHS = {"fp8": ["ours-direct+quant"], "fp4": ["ours-fp4+quant"], "bf16": ["sdpa-cudnn-bf16", "sdpa-flash-bf16"],
         # the kernels alone: what the quantization pass adds is the difference, which a GQA
         # site pays on fewer K/V heads (policy.CostTable.speedup)
         "fp8-kernel": ["ours-direct"], "fp4-kernel": ["ours-fp4"]}
TRAINING_PATHS = {"fp8": ["ours-direct-compiled"], "bf16": ["sdpa-cudnn-bf16", "sdpa-flash-bf16"],
                  # the hybrid path, by the BF16 backward it ran (policy.PricedPath.rates)
                  "fp8+bf16bwd:fa4": ["ours-hybrid-fa4"], "fp8+bf16bwd:cudnn": ["ours-hybrid-cudnn"]}
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


# What a masked row's low-precision rate is read from: the forward with its quantization
# (explore_masked_sites.py), the compiled training step on the shipped kernels
# (explore_padded_training.py, whose Gluon variant is what ships).
MASKED_OURS = {"fwd": "ours_with_quant", "train": "gluon_key_bias"}


def _add_masked_rates(rates, rows, mode):
    """explore_masked_sites.py's (``mode`` "fwd") or explore_padded_training.py's
    ("train") rows, in the FLOPs the policy counts for the site (its causal structure's,
    not the padding's): keyed like ``SiteShape.table_key``, left and right padding
    sharing a key, the slower of them for low precision and the faster for BF16, so the
    policy never credits the better case."""
    for row in rows:
        key = f"d{row['d']}/{'causal' if row['causal'] else 'full'}/{mode}/{row['mask_kind'].split(' ')[0]}"
        for path, name, pick in (("fp8", MASKED_OURS[mode], min), ("bf16", "sdpa_bf16_dense_mask", max)):
            rate = round(row[f"{name}_table_tflops"], 1)
            old = rates[path][key].get(str(row["n"]))
            rates[path][key][str(row["n"])] = rate if old is None else pick(old, rate)


def main(forward: str, *training: str, masked: tuple[str, ...] = (), masked_training: tuple[str, ...] = ()) -> None:
    """``training``: ``bench_attention.py --training`` JSONs (causal, and non-causal with
    ``--non-causal``); their rows are keyed by their own causality.  ``masked``:
    ``explore_masked_sites.py`` JSONs; ``masked_training``: ``explore_padded_training.py
    --compile`` JSONs."""
    docs = [("fwd", forward, json.loads(Path(forward).read_text()))]
    docs += [("train", path, json.loads(Path(path).read_text())) for path in training]
    rates: dict = defaultdict(lambda: defaultdict(dict))
    for mode, _, doc in docs:
        _add_rates(rates, doc["results"], PATHS if mode == "fwd" else TRAINING_PATHS, mode)
    for mode, paths in (("fwd", masked), ("train", masked_training)):
        for path in paths:
            doc = json.loads(Path(path).read_text())
            if mode == "train" and not doc["compiled"]:
                raise SystemExit(f"{path}: an eager run; the table prices the compiled step (--compile)")
            _add_masked_rates(rates, doc["rows"], mode)
            docs.append(("masked", path, {"env": doc["environment"]}))
    gpu = docs[0][2]["env"]["device"]
    table = {
        "gpu": gpu,
        "source": "; ".join(f"{Path(path).name} ({doc['env'].get('date', '')}, torch {doc['env'].get('torch', '')})"
                            for _, path, doc in docs),
        "launch_us": LAUNCH_US,
        "tflops": rates,
    }
    out = policy.table_path(gpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(out)


def update(*training: str) -> None:
    """Fold further ``--training`` JSONs into the GPU's existing table (rows they measure
    are set, BF16's to the faster of old and new; the others stay)."""
    docs = [(path, json.loads(Path(path).read_text())) for path in training]
    out = policy.table_path(docs[0][1]["env"]["device"])
    table = json.loads(out.read_text())
    rates = defaultdict(lambda: defaultdict(dict), {p: defaultdict(dict, by_key) for p, by_key in table["tflops"].items()})
    for path, doc in docs:
        fresh: dict = defaultdict(lambda: defaultdict(dict))
        _add_rates(fresh, doc["results"], TRAINING_PATHS, "train")
        for name, by_key in fresh.items():
            for key, points in by_key.items():
                for n, rate in points.items():
                    old = rates[name][key].get(n)
                    rates[name][key][n] = max(old, rate) if name == "bf16" and old is not None else rate
        table["source"] += f"; {Path(path).name} ({doc['env'].get('date', '')}, torch {doc['env'].get('torch', '')})"
    table["tflops"] = rates
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", nargs="*", default=None, help="only fold these --training JSONs into the table")
    ap.add_argument("forward", nargs="?", help="bench_attention.py's forward JSON")
    ap.add_argument("training", nargs="*", help="bench_attention.py --training JSONs (causal, non-causal)")
    ap.add_argument("--masked", nargs="*", default=[], help="explore_masked_sites.py JSONs")
    ap.add_argument("--masked-training", nargs="*", default=[], help="explore_padded_training.py --compile JSONs")
    args = ap.parse_args()
    if args.update:
        update(*args.update)
        raise SystemExit
    main(args.forward, *args.training, masked=tuple(args.masked), masked_training=tuple(args.masked_training))
