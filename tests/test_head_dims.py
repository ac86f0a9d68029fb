"""Every head dim real models use (multiples of 8 from 32 to 256, D_v of its own), through
SDPA and hand-written attention, inference and training, on the reference path (CPU)."""

import pytest
import torch
import torch.nn.functional as F

import fp4_inductor
from helpers import cosine, op_calls

DIMS = [32, 40, 72, 80, 96, 160, 256]


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _handwritten(q, k, v, causal):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return F.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("fn", [_sdpa, _handwritten], ids=["sdpa", "softmax"])
@pytest.mark.parametrize("d", DIMS)
def test_head_dim_inference_and_training(d, fn):
    causal = d in (40, 80, 160, 256)  # each dim once, both kinds, causal and not across the set
    q, k, v = (torch.randn(2, 3, 70, d, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 3, 70, d)

    def step(f):
        for t in (q, k, v):
            t.grad = None
        out = f(q, k, v, causal)
        out.backward(grad_out)
        return out.detach(), torch.cat([t.grad.flatten() for t in (q, k, v)])

    ref_out, ref_grads = step(fn)
    with fp4_inductor.configure(policy="always"):
        (out, grads), calls = op_calls(step, torch.compile(fn, backend="fp4attn"))
    assert calls == {"fwd": 1, "bwd": 1}
    assert cosine(out, ref_out) >= 0.99
    assert cosine(grads, ref_grads) >= 0.98


def test_value_head_dim_of_its_own():
    """D_qk 192 with D_v 128 (DeepSeek's MLA shapes)."""
    q, k = torch.randn(1, 2, 70, 192), torch.randn(1, 2, 90, 192)
    v = torch.randn(1, 2, 90, 128)
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                                            backend="fp4attn"), q, k, v)
    assert calls["fwd"] == 1 and out.shape == (1, 2, 70, 128)
    assert cosine(out, F.scaled_dot_product_attention(q, k, v)) >= 0.99


def test_unmeasured_head_dim_keeps_bf16_under_auto(monkeypatch):
    """A head dim without a measured rate keeps BF16 with the reason; tune() measures it."""
    from fp4_inductor import policy
    from fp4_inductor.config import Options
    from test_policy import _site

    monkeypatch.setattr(policy, "kernels_run_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    decision = policy.decide(_site(d=80, n=16384), Options())
    assert decision.path == "bf16" and "not measured on this GPU" in decision.reason
    assert policy.decide(_site(d=128, n=16384), Options()).path == "fp8"  # a measured one still wins
