"""Shared test utilities (tests only; the package never imports this)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


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


def grads(fn, inputs, grad_out=None):
    """Output and gradients w.r.t. ``inputs`` (leaf tensors)."""
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(grad_out if grad_out is not None else torch.ones_like(out))
    return out.detach(), [t.grad.detach().clone() for t in inputs]
