"""Triton helpers shared by the kernels."""

import triton
import triton.language as tl


@triton.jit
def e2m1_round(u):
    """Nearest E2M1 magnitude of u >= 0 (ties round down, as formats.e2m1_round)."""
    q = tl.where(u > 0.25, 0.5, 0.0)
    q += tl.where(u > 0.75, 0.5, 0.0)
    q += tl.where(u > 1.25, 0.5, 0.0)
    q += tl.where(u > 1.75, 0.5, 0.0)
    q += tl.where(u > 2.5, 1.0, 0.0)
    q += tl.where(u > 3.5, 1.0, 0.0)
    q += tl.where(u > 5.0, 2.0, 0.0)
    return q


@triton.jit
def max_propagate_nan(a, b):
    """Combine function for NaN-propagating max reductions (torch.amax's semantics)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
