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


@triton.jit
def e4m3_round(y):
    """float32 y with |y| <= 448 rounded to the nearest E4M3 value, ties to even, in
    float32 arithmetic (the interpreter's float8 casts do not round like the GPU's)."""
    a = tl.abs(y)
    # The E4M3 quantum at a's binade is 2**(e - 3), e >= -6 (below: subnormals, 2**-9).
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / ulp + 8388608.0) - 8388608.0) * ulp  # a / ulp <= 16: the add rounds to an integer
    return tl.where(y < 0, -r, r)


@triton.jit
def e4m3_code_value(code):
    """float32 value of the E4M3 code held in the low byte of int32 ``code`` (0..126):
    ``code << 20`` is the float32 pattern of value * 2**-120."""
    return ((code & 0xFF) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2**120


@triton.jit
def mul_rn(a, b, EMULATE: tl.constexpr):
    """a * b rounded on its own (never contracted into an FMA by ptxas); the interpreter
    has no libdevice, and numpy never contracts."""
    if EMULATE:
        return a * b
    else:
        return tl.extra.cuda.libdevice.mul_rn(a, b)
