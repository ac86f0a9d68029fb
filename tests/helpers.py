"""Shared test utilities (tests only; the package never imports this)."""

from __future__ import annotations

import math

import torch
from torch.profiler import ProfilerActivity, profile

from fp4_inductor import formats as F
from fp4_inductor.formats import MASKED_LOG2


def bits(t: torch.Tensor) -> torch.Tensor:
    """8-bit codes as uint8, to compare exactly (CPU float8 lacks comparison ops)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def compiled_graphs(fn, policy: str, run) -> int:
    """How many graphs Dynamo compiles, from a fresh start, while ``run(compiled)`` calls
    ``fn`` compiled with ``backend="fp4attn"`` under ``policy``."""
    import fp4_inductor

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with fp4_inductor.configure(policy=policy):
        run(torch.compile(fn, backend="fp4attn"))
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()


def op_calls(fn, *args, **kwargs) -> tuple[object, dict[str, int]]:
    """Run ``fn`` once to compile it (compilation traces the ops on fake tensors, which
    the profiler would count), then again under the profiler; return the second result
    and how often each fp4attn op ran in that call."""
    fn(*args, **kwargs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn(*args, **kwargs)
    counts = {"fwd": 0, "bwd": 0}
    for event in prof.events():
        for op in counts:
            if event.name == f"fp4attn::{op}":
                counts[op] += 1
    return result, counts


def fwd_inputs(fn, *args, **kwargs) -> tuple[object, list[list]]:
    """Run ``fn`` once to compile it, then again under the profiler: the second result and
    the input shapes of each ``fp4attn::fwd`` call (q8, k8, v_t, scales, bias, ...)."""
    fn(*args, **kwargs)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn(*args, **kwargs)
    return result, [list(e.input_shapes) for e in prof.events() if e.name == "fp4attn::fwd"]


def grads(fn, inputs, grad_out=None):
    """Output and gradients w.r.t. ``inputs`` (leaf tensors)."""
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(grad_out if grad_out is not None else torch.ones_like(out))
    return out.detach(), [t.grad.detach().clone() for t in inputs]


def documents_of(lengths) -> torch.Tensor:
    """Packed-sequence document ids ``[B, N]`` from each batch row's document lengths
    (each row's summing to N): 0 for the first document's tokens, 1 for the next, ..."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def quantized_operands(b, h, hkv, nq, nk, d, p_mode, bias_kind=None, scale=1.0, dv=None):
    """Gaussian Q, K, V quantized as attention.py does (on the CPU), the forward op's
    operands ``(q8, k8, v_t, q_scale, k_scale, v_scale)``, and an optional log2 bias:
    ``"keypad"`` (a boolean key-padding mask as lowered: random keys), ``"rightpad"`` /
    ``"leftpad"`` (per-sequence lengths), ``"keyrow"`` (random, per head and key) or
    ``"dense"`` (random).
    ``dv``: the value head dim, if not ``d``."""
    q = torch.randn(b, h, nq, d) * scale
    k = torch.randn(b, hkv, nk, d) * scale
    v = torch.randn(b, hkv, nk, dv or d)
    operands = F.quantize_inputs(q, k, v, 1.0 / math.sqrt(d), "fp4" if p_mode == "fp4" else "fp8")
    bias = None
    if bias_kind == "keypad":
        keep = torch.rand(b, 1, 1, nk) > 0.3
        keep[..., 0] = True
        bias = torch.where(keep, 0.0, MASKED_LOG2)
    elif bias_kind in ("rightpad", "leftpad"):
        # Each batch row keeps a random number of keys at its start (right padding) or end
        # (left padding); the last batch row none when B > 1 (rows with no visible key).
        lengths = torch.randint(1, nk + 1, (b,))
        if b > 1:
            lengths[-1] = 0
        pos = torch.arange(nk) if bias_kind == "rightpad" else torch.arange(nk).flip(0)
        keep = pos[None, :] < lengths[:, None]
        bias = torch.where(keep, 0.0, MASKED_LOG2)[:, None, None, :]
    elif bias_kind == "keyrow":  # an additive bias per (batch, head) and key, as ALiBi-like rows
        bias = torch.randn(b, h, 1, nk) * 2
    elif bias_kind == "dense":
        bias = torch.randn(b, h, nq, nk) * 2
    return operands, bias
