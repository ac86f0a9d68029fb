"""Where the Gluon forward beats the Triton one: both kernels on the same quantized
operands (P mode direct), by query and key count, D = 64 and 128, causal (as many queries
as keys, SDPA's top-left structure) and not (also few
queries: cross attention, chunked prefill over a full prefix), and causal with a 4096-key
sliding window (TFLOP/s counted on the visible pairs, next to plain causal's).  The data
behind ``kernels.GLUON_MIN_KEYS`` and ``_gluon_wins`` (H200).

    python benchmarks/lab/explore_dispatch.py

B = 16384 // Nk sequences of H = 2048 // D heads.  Writes
benchmarks/results/lab/explore_dispatch_h200.json; the table gives Triton's time over
Gluon's (above 1: Gluon faster).
"""

from __future__ import annotations

import os
import sys

import torch
from tqdm import tqdm
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402

from fp4_inductor.kernels.gluon import attention_fwd as G  # noqa: E402
from fp4_inductor.kernels.triton import attention_fwd as A  # noqa: E402

KEYS = (1024, 2048, 4096, 8192)
WINDOW = 4096


def cases():
    for d in (128, 64):
        for nk in KEYS:
            for nq in (nk, 1024, 256):
                if nq <= nk:
                    yield d, nq, nk, False, 0
            yield d, nk, nk, True, 0
        for nk in (8192, 16384):
            yield d, nk, nk, True, WINDOW
            yield d, nk, nk, True, 0


def visible_pairs(nq, nk, causal, window):
    if not causal:
        return nq * nk
    w = window or nk
    return sum(min(i + 1, w) for i in range(min(nq, nk)))


def main():
    doc = {"environment": C.environment(), "rows": []}
    todo = list(dict.fromkeys(cases()))
    for d, nq, nk, causal, window in tqdm(todo):
        torch.manual_seed(0)
        b, h = C.fa3_shape(nk, d)
        _, ops = C.quantized_inputs(b, h, h, nq, nk, d, "direct")
        row = {"d": d, "nq": nq, "nk": nk, "causal": causal, "window": window, "b": b, "h": h}
        flops = 4.0 * b * h * d * visible_pairs(nq, nk, causal, window)
        outputs = {}
        for name, launch in (("triton", A.attention_forward), ("gluon", G.attention_forward)):
            out = C.empty_outputs(b, h, nq, d)
            run = lambda: launch(*ops, None, causal, "direct", *out, window=window)  # noqa: E731
            run()
            row[f"{name}_ms"] = do_bench(run, return_mode="median")
            row[f"{name}_visible_tflops"] = flops / row[f"{name}_ms"] / 1e9
            outputs[name] = out[0].float()
        row["triton_over_gluon"] = row["triton_ms"] / row["gluon_ms"]
        row["max_abs_diff"] = (outputs["triton"] - outputs["gluon"]).abs().max().item()
        doc["rows"].append(row)
        del ops, outputs
    C.save(doc, os.path.join(C.RESULTS, "lab", "explore_dispatch_h200.json"))
    print(f"{'D':>4s} {'causal':>6s} {'Nq':>6s} " + " ".join(f"{nk:>7d}" for nk in KEYS) + "   (Nk; Triton ms / Gluon ms)")
    for d in (128, 64):
        for causal, nqs in ((False, ("Nk", 1024, 256)), (True, ("Nk",))):
            for nq in nqs:
                cells = []
                for nk in KEYS:
                    want = nk if nq == "Nk" else nq
                    hit = [r for r in doc["rows"]
                           if (r["d"], r["nq"], r["nk"], r["causal"], r["window"]) == (d, want, nk, causal, 0)]
                    cells.append(f"{hit[0]['triton_over_gluon']:7.2f}" if hit else f"{'-':>7s}")
                print(f"{d:4d} {str(causal):>6s} {str(nq):>6s} " + " ".join(cells))
    print(f"causal, TFLOP/s on visible pairs (Gluon / Triton), window {WINDOW} vs none:")
    for r in doc["rows"]:
        if r["causal"] and r["nk"] >= 8192:
            print(f"  D={r['d']:<4d} N={r['nk']:<6d} window={r['window']:<5d} "
                  f"{r['gluon_visible_tflops']:6.0f} / {r['triton_visible_tflops']:6.0f}")


if __name__ == "__main__":
    main()
