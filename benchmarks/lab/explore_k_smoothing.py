"""What K's smoothing vector costs in accuracy: the mean over all tokens (two passes over
K: a reduction across the whole sequence, then the quantization) against the mean of the
first SCALE_BLOCK tokens or of K_MEAN_SAMPLES tokens spread over the sequence (one pass:
formats.smooth_k since this study) and no smoothing.  Any vector shared by a head's keys leaves softmax unchanged, so only
the INT8 rounding of K differs.  CPU: the reference emulation computes the kernels'
numbers.

    python benchmarks/lab/explore_k_smoothing.py     # table; JSON under benchmarks/results/lab/

Inputs: Gaussian; Gaussian K with a per-channel offset shared by the tokens (what real
models' K has); the same with rotary embeddings (Llama's: the offset turns with the
position, so a local mean is not the global one); all-MiniLM-L6-v2's activations on a
512-token text.  Each: the fp8 Direct-P output's rel-L2 against float64 attention.
``output_error`` and ``compare`` serve the other numerics studies here too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import RESULTS, environment  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor import reference  # noqa: E402


def global_mean(kf):
    return kf.mean(dim=-2, keepdim=True)


def first_block_mean(kf):
    return kf[..., :F.SCALE_BLOCK, :].mean(dim=-2, keepdim=True)


def sampled_mean(kf):
    n = kf.shape[-2]
    rows = torch.arange(min(n, F.K_MEAN_SAMPLES)) * n // min(n, F.K_MEAN_SAMPLES)
    return kf[..., rows, :].mean(dim=-2, keepdim=True)


def no_mean(kf):
    return torch.zeros_like(kf[..., :1, :])


VARIANTS = {"all tokens (v6)": global_mean, "first block": first_block_mean,
            "128 tokens spread over the sequence": sampled_mean, "none": no_mean}


@contextlib.contextmanager
def smoothing(mean_of):
    saved = F.smooth_k
    F.smooth_k = lambda k: k.float() - mean_of(k.float())
    try:
        yield
    finally:
        F.smooth_k = saved


def output_error(ops, q, k, v, causal, p_mode: str = "direct") -> float:
    """rel-L2 of the fp8 reference output (P mode ``p_mode``) on the quantized ``ops``
    against float64 attention of ``q, k, v`` (softmax scale D**-0.5)."""
    out = reference.attention_forward(*ops, None, causal, p_mode, torch.float32)[0].double()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                                           scale=q.shape[-1] ** -0.5)
    return ((out - ref).norm() / ref.norm()).item()


def smoothed_error(mean_of, q, k, v, causal) -> float:
    with smoothing(mean_of):
        return output_error(F.quantize_inputs(q, k, v, q.shape[-1] ** -0.5, "fp8"), q, k, v, causal)


def rotary(x):
    n, d = x.shape[-2], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def synthetic(n, d, heads, gen):
    q, k, v = (torch.randn(1, heads, n, d, generator=gen) for _ in range(3))
    offset = 3.0 * torch.randn(1, heads, 1, d, generator=gen)  # K's shared channel bias
    return {"gaussian": (q, k, v), "K channel offset": (q, k + offset, v),
            "K offset + rotary": (rotary(q), rotary(k + offset), v)}


def minilm_text():
    """all-MiniLM-L6-v2's Q, K, V per layer on one 512-token text."""
    import all_minilm_l6_v2
    import transformers
    from accuracy_real import SENTENCES, capture_sites

    with contextlib.redirect_stdout(io.StringIO()):
        path = str(all_minilm_l6_v2.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    text = " ".join(SENTENCES * 12)
    batch = tok([text], truncation=True, max_length=512, return_tensors="pt")
    return {f"MiniLM layer {i}": (s["q"], s["k"], s["v"]) for i, s in enumerate(capture_sites(model, batch))}


def compare(synthetic_inputs: dict, variants: dict, error, path: str) -> None:
    """``error(variant, q, k, v, causal)`` for every variant on each synthetic input (full
    and causal) and on MiniLM's layers (full); a table, and JSON at ``path``."""
    cases = [(name, t, causal) for name, t in synthetic_inputs.items() for causal in (False, True)]
    cases += [(name, t, False) for name, t in minilm_text().items()]
    rows = []
    for name, (q, k, v), causal in cases:
        row = {"input": name, "causal": causal, "shape": list(q.shape)}
        row.update({label: error(variant, q, k, v, causal) for label, variant in variants.items()})
        rows.append(row)
        print(f"{name:26s} {'causal' if causal else 'full':6s} "
              + "  ".join(f"{label}: {row[label]:.4f}" for label in variants), flush=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), "metric": "fp8 direct output rel-L2 vs float64", "rows": rows},
                  f, indent=1)
    print(f"wrote {path}")


def main():
    compare(synthetic(2048, 128, 4, torch.Generator().manual_seed(0)), VARIANTS, smoothed_error,
            os.path.join(RESULTS, "lab", "explore_k_smoothing.json"))

if __name__ == "__main__":
    main()
