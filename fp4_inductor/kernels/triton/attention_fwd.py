"""Hopper (sm_90) forward attention in Triton: INT8 Q.K^T, E4M3 P.V.

Computes what ``reference.attention_forward`` specifies: key tiles of
``formats.KEY_TILE`` keys in ascending order, an integer running row maximum, and the
probability operand of ``formats.probability_operand`` (bit-identical codes).  Row sums
and the running output are float32; each tile's P.V is accumulated by the fp8 tensor
cores (fewer mantissa bits than float32), so outputs match the reference to ~1e-4
rel-L2 and the LSE to ~2e-6 (docs/perf-notes/2026-11.md, "Forward kernel performance
notes", "Accuracy").

One kernel family, specialised at compile time on the P mode, causal structure (a
diagonal offset and a sliding window, ``formats.visible``; key tiles it hides are skipped,
tiles it keeps whole run without masking arithmetic), bias and head dims (Q/K and V
apart; any multiple of 8 from 32 to 256, in tiles of the next power of two with the
padding channels masked to zero).  The launcher keeps the caller's strides (O is written
in its [B, N, H, D] storage), indexes the shared K/V head for GQA/MQA, and never copies K
or V.  Under Triton's interpreter (``EMULATE``) the PTX-only steps (saturating FMA,
float8 conversions, libdevice) run as float32 arithmetic with the same results.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ... import formats as F
from . import documents, key_bias
from .common import e2m1_round, e4m3_code_value, e4m3_round, max_propagate_nan, mul_rn

_P_MODE_ID = {"direct": 0, "exp": 1, "fp4": 2}
BLOCK_N = F.KEY_TILE  # one K scale per key tile: the tile must be the scale block
assert F.KEY_TILE == F.SCALE_BLOCK == 128


@triton.jit
def _fma_sat(x, a, b, EMULATE: tl.constexpr):
    """fma(x, a, b) clamped to [0, 1] in the same instruction (FFMA.SAT)."""
    if EMULATE:
        return tl.minimum(tl.maximum(tl.fma(x, a, b), 0.0), 1.0)
    else:
        return tl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f", [x, a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _e4m3_code(v):
    """E4M3 code (RNE, saturating) of float32 ``v`` as an int32 0..126, one cvt each.
    Written out in PTX because Triton 3.6's float32 -> fp8 tensor conversion, on the
    wgmma accumulator layout feeding this kernel's P path, gave wrong codes on the H200
    (docs/perf-notes/2026-11.md, "Things met on the way"); the int32 code then takes the same path as Direct-P's."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, 0f00000000, $1; cvt.u32.u16 $0, t; }",
        "=r,f", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _p_operand(v, EMULATE: tl.constexpr):
    """The E4M3 P operand of non-negative float32 ``v`` (saturating) and its row sums."""
    if EMULATE:
        p = e4m3_round(tl.minimum(v, 448.0))
        return p, tl.sum(p, 1)
    else:
        code = _e4m3_code(v)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), _row_sum_of_codes(code)


@triton.jit
def _row_sum_of_codes(code):
    """Row sums of the E4M3 values whose codes (0..126) are the low byte of the int32
    ``code`` (bits 12 and up are shifted out): code << 20 is the float32 pattern of
    value * 2**-120 (codes 1..7 land on float32 subnormals, which add exactly), so one
    shift and one add per element, no cvt."""
    tiny = (code << 20).to(tl.float32, bitcast=True)
    return tl.sum(tiny, 1) * 1.329227995784916e36  # 2**120


@triton.jit
def _probability(x, x_scale, m_new, P_MODE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """E4M3 P operand of one key tile and its row sum (of the same E4M3 values).  The log2
    scores are x * x_scale * 32: Direct-P takes x = s, the integer scores, with
    x_scale = t / 32 (the product folded into its FFMA, unrounded), or the log2 scores
    with x_scale = 1 / 32; the other modes take the log2 scores (x_scale unused)."""
    if P_MODE == 0:
        # Direct-P: code = rne(clamp(8 x + 120 - 8 m, 0, 126)).  Computed as
        # z = sat(x / 32 + (120 - 8 m) / 256) = fl(8 x + 120 - 8 m) / 256 (power-of-two
        # scaling commutes with rounding), the clamp being the FFMA's saturation (x <= m
        # keeps z <= 120 / 256, so only 0 can bind).  z + 2**15 rounds z * 256 to the
        # nearest integer, ties to even, into the low mantissa byte: the code.
        z = _fma_sat(x, x_scale, ((120.0 - 8.0 * m_new) * 0.00390625)[:, None], EMULATE)
        bits = (z + 32768.0).to(tl.int32, bitcast=True)
        if EMULATE:
            p = e4m3_code_value(bits)
        else:
            p = bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        l_tile = _row_sum_of_codes(bits)  # the shift drops the magic's exponent bits
    elif P_MODE == 1:
        # exp2 on the MUFU, E4M3 from the cvt instruction (RNE, saturating).
        p, l_tile = _p_operand(tl.math.exp2(x - m_new[:, None] + 8.0), EMULATE)
    else:
        FP4_BLOCK: tl.constexpr = 32
        rel = tl.reshape(x - m_new[:, None], (BLOCK_M, BLOCK_N // FP4_BLOCK, FP4_BLOCK))
        e = tl.math.ceil(tl.reduce(rel, 2, max_propagate_nan))
        live = e > float("-inf")
        e = tl.where(live, e, 0.0)
        xc = rel - e[:, :, None] + 2.584962500721156  # log2(6)
        # mul_rn: the reference rounds a*xc before adding b; keep ptxas from fusing.
        u = tl.maximum(mul_rn(xc, 1.5, EMULATE) + 1.2, 0.0)
        q = e2m1_round(u)
        q = tl.where(live[:, :, None] & (rel > float("-inf")), q, 0.0)
        # 2**(e + 6) built from its exponent bits; below 2**-126 it is 0 (E4M3 rounds any
        # such value to 0 anyway).
        ebits = tl.maximum(e.to(tl.int32) + (127 + 6), 0) << 23
        scale = ebits.to(tl.float32, bitcast=True)
        p, l_tile = _p_operand(tl.reshape(q * scale[:, :, None], (BLOCK_M, BLOCK_N)), EMULATE)
    return p, l_tile


@triton.jit
def _load_k(K, k_ptrs, b, hk, start_n, offs_key, offs_d, NK, stride_kn,
            USE_TMA: tl.constexpr, PERM_P: tl.constexpr, MASKED: tl.constexpr,
            D_QK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """K^T [HEAD_DIM, BLOCK_N] of one key tile in key order ``offs_key`` (K-major, as the
    8-bit wgmma wants), zero in the padding channels past D_QK.  TMA zero-fills keys past
    NK; the pointer path masks them.  A permuted K is a row gather: pointers only."""
    if USE_TMA and not PERM_P:
        k = tl.trans(K.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM))
    elif MASKED:
        ok = ((start_n + offs_key) < NK)[None, :]
        if D_QK < HEAD_DIM:
            ok = ok & (offs_d < D_QK)[:, None]
        k = tl.load(k_ptrs + start_n * stride_kn, mask=ok, other=0)
    elif D_QK < HEAD_DIM:
        k = tl.load(k_ptrs + start_n * stride_kn, mask=(offs_d < D_QK)[:, None], other=0)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn)
    return k


@triton.jit
def _load_v(VT, v_ptrs, b, hk, start_n, offs_dv, NK, stride_vn,
            USE_TMA: tl.constexpr, MASKED: tl.constexpr, D_V: tl.constexpr, HEAD_DIM_V: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """V^T [HEAD_DIM_V, BLOCK_N] of one key tile in natural key order (K-major for P.V),
    zero in the padding channels past D_V."""
    if USE_TMA:
        v = VT.load([b, hk, 0, start_n]).reshape(HEAD_DIM_V, BLOCK_N)
    elif MASKED:
        ok = ((start_n + tl.arange(0, BLOCK_N)) < NK)[None, :]
        if D_V < HEAD_DIM_V:
            ok = ok & (offs_dv < D_V)[:, None]
        v = tl.load(v_ptrs + start_n * stride_vn, mask=ok, other=0.0)
    elif D_V < HEAD_DIM_V:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=(offs_dv < D_V)[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs + start_n * stride_vn)
    return v


@triton.jit
def _key_permutation(BLOCK_N: tl.constexpr):
    """Key held by S column c when K rows are gathered so that each thread's wgmma
    accumulator fragment of P is already its fp8 A-operand fragment (no shuffles).

    Accumulator: lane quad q holds columns 8j + 2q + {0, 1}; the k32 fp8 A operand wants
    keys 4q + {0..3} and 16 + 4q + {0..3}.  With c = 32ch + 16jh + 8jl + 2q + b the key is
    32ch + 16jh + 4q + 2jl + b (FA3 permutes V for the same purpose)."""
    c = tl.arange(0, BLOCK_N)
    ch = c // 32
    jh = (c // 16) % 2
    jl = (c // 8) % 2
    qq = (c // 2) % 4
    bb = c % 2
    return ch * 32 + jh * 16 + qq * 4 + jl * 2 + bb


@triton.jit
def _unpermute_p(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """P with columns in key order, from P in gathered order: a pure relabelling of
    registers (see _key_permutation)."""
    p = tl.reshape(p, (BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2))
    p = tl.permute(p, (0, 1, 2, 4, 3, 5))
    return tl.reshape(p, (BLOCK_M, BLOCK_N))


@triton.jit
def _update(
    acc, l_i, m_i, s, v, start_n, row_t, ks_ptr, b_ptrs, q_doc, kd_ptr, offs_m, offs_key, NK, DIAGONAL, WINDOW,
    stride_bn, P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BIAS_MODE: tl.constexpr,
    DOCUMENTS: tl.constexpr, MASKED: tl.constexpr, PERM_P: tl.constexpr, PV_SPLIT: tl.constexpr, CVT_I2F: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online-softmax update with one key tile: int32 scores ``s`` [BLOCK_M, BLOCK_N] in
    key order ``offs_key``, V^T tile ``v``; ``q_doc`` the rows' document ids and ``kd_ptr``
    the keys' (DOCUMENTS)."""
    if CVT_I2F:
        s = s.to(tl.float32)  # exact (|s| < 2**21); one I2FP, fewer instructions than the magic add
    else:
        s = (s + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0  # exact int32 -> f32
    t = row_t * tl.load(ks_ptr + start_n // BLOCK_N)
    key_ok = (start_n + offs_key) < NK
    if MASKED:
        ok = key_ok[None, :]
        if CAUSAL:  # formats.visible
            keys = (start_n + offs_key)[None, :]
            ok = ok & (keys <= offs_m[:, None] + DIAGONAL)
            if WINDOWED:
                ok = ok & (keys > offs_m[:, None] + (DIAGONAL - WINDOW))
        if DOCUMENTS:
            k_doc = tl.load(kd_ptr + start_n + offs_key, mask=key_ok, other=-1)
            ok = ok & (k_doc[None, :] == q_doc[:, None])
    if P_MODE == 0 and BIAS_MODE == 0:
        # Direct-P without a bias never forms x = s t: its FFMA takes the product
        # unrounded (reference.log2_scores), and the row maximum of x is the rounded
        # product of the row's largest score (rounding is monotonic, t > 0).
        if MASKED:
            s = tl.where(ok, s, float("-inf"))
        s_max = tl.reduce(s, 1, max_propagate_nan)
        x_max = tl.where(s_max == float("-inf"), s_max, mul_rn(s_max, t, EMULATE))
        x, x_scale = s, (t * 0.03125)[:, None]
    else:
        if BIAS_MODE == 0:
            # mul_rn: x is rounded on its own, as in the reference; a plain multiply may be
            # contracted with the next subtraction (x - m) into one FMA.
            x = mul_rn(s, t[:, None], EMULATE)
        else:
            if BIAS_MODE == 1:  # the same bias row for every query (key padding)
                if MASKED:
                    bias = tl.load(b_ptrs + start_n * stride_bn, mask=key_ok, other=0.0)[None, :]
                else:
                    bias = tl.load(b_ptrs + start_n * stride_bn)[None, :]
            else:
                if MASKED:
                    bias = tl.load(b_ptrs + start_n * stride_bn, mask=key_ok[None, :], other=0.0)
                else:
                    bias = tl.load(b_ptrs + start_n * stride_bn)
            x = tl.fma(s, t[:, None], bias)  # one rounding, as the reference's FMA
        if MASKED:
            x = tl.where(ok, x, float("-inf"))
        x_max = tl.reduce(x, 1, max_propagate_nan)
        x_scale = 0.03125
    m_new = tl.maximum(m_i, tl.math.ceil(x_max), propagate_nan=tl.PropagateNan.ALL)
    # Rows still fully masked keep m = -inf and alpha = 1; NaN rows stay NaN.
    alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_new))
    # A row with no visible key yet (a window or offset hides the tile from it) has P = 0
    # whatever its reference: 0 instead of -inf keeps x - m from NaN, as the reference's.
    p, l_tile = _probability(x, x_scale, tl.where(m_new == float("-inf"), 0.0, m_new), P_MODE, EMULATE,
                             BLOCK_M, BLOCK_N)
    if PERM_P:
        p = _unpermute_p(p, BLOCK_M, BLOCK_N)
    if EMULATE:
        v = v.to(tl.float32)
    l_i = l_i * alpha + l_tile
    if PV_SPLIT:
        # Two-level accumulation: the fp8 wgmma accumulates this tile only (it keeps
        # ~14 mantissa bits), float32 FFMAs carry the running sum.
        acc = acc * alpha[:, None] + tl.dot(p, tl.trans(v))
    else:
        acc = tl.dot(p, tl.trans(v), acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _attend(
    acc, l_i, m_i, q, row_t, K, VT, k_ptrs, v_ptrs, b_ptrs, ks_ptr, q_doc, kd_ptr, b, hk,
    offs_m, offs_key, offs_d, offs_dv, start, stop, NK, DIAGONAL, WINDOW, stride_kn, stride_vn, stride_bn,
    P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BIAS_MODE: tl.constexpr,
    DOCUMENTS: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, PERM_P: tl.constexpr, PV_SPLIT: tl.constexpr,
    CVT_I2F: tl.constexpr, EMULATE: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Key tiles [start, stop): MASKED=False for tiles wholly inside the sequence and
    the causal structure, so the common loop carries no masking arithmetic."""
    for start_n in range(start, stop, BLOCK_N):
        k = _load_k(K, k_ptrs, b, hk, start_n, offs_key, offs_d, NK, stride_kn, USE_TMA, PERM_P, MASKED, D_QK,
                    HEAD_DIM, BLOCK_N)
        v = _load_v(VT, v_ptrs, b, hk, start_n, offs_dv, NK, stride_vn, USE_TMA, MASKED, D_V, HEAD_DIM_V,
                    BLOCK_N)
        s = tl.dot(q, k, out_dtype=tl.int32)
        acc, l_i, m_i = _update(acc, l_i, m_i, s, v, start_n, row_t, ks_ptr, b_ptrs, q_doc, kd_ptr, offs_m, offs_key,
                                NK, DIAGONAL, WINDOW, stride_bn, P_MODE, CAUSAL, WINDOWED, BIAS_MODE, DOCUMENTS,
                                MASKED, PERM_P, PV_SPLIT, CVT_I2F, EMULATE, BLOCK_M, BLOCK_N)
    return acc, l_i, m_i


@triton.jit
def _tile_range(m0, NK, DIAGONAL, WINDOW, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of queries [m0, m0 + BLOCK_M): (lo, full_lo, full_hi, hi), key offsets
    in multiples of BLOCK_N but ``hi``.  [lo, hi) holds every visible key; the tiles in
    [full_lo, full_hi) are wholly visible to every row and inside the keys.  Offsets are
    clamped at 0 before dividing (Triton's integer division truncates)."""
    lo = 0
    hi = NK
    full_lo = 0
    full_hi = (NK // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(NK, tl.maximum(m0 + BLOCK_M + DIAGONAL, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + 1 + DIAGONAL, 0) // BLOCK_N) * BLOCK_N)
        if WINDOWED:
            lo = (tl.maximum(m0 + 1 + DIAGONAL - WINDOW, 0) // BLOCK_N) * BLOCK_N
            full_lo = ((tl.maximum(m0 + BLOCK_M + DIAGONAL - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    lo = tl.minimum(lo, hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


# Scalars that only index scales, LSE and bias rows, or count rows and keys: specialising
# on their divisibility would only multiply compiled variants.
_NO_SPECIALIZE = ["stride_vb", "stride_vh", "stride_vd", "stride_qsb", "stride_qsh", "stride_ksb", "stride_ksh",
                  "stride_vsb", "stride_vsh", "stride_bb", "stride_bh", "stride_bm", "stride_lb", "stride_lh",
                  "range_b", "range_h", "H", "GROUP", "NQ", "NK", "N_BUCKET", "DIAGONAL", "WINDOW", "stride_qdb",
                  "stride_kdb", "stride_drb"]


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _fwd_kernel(
    Q, K, VT, QS, KS, VS, BIAS, RANGES, QDOC, KDOC, DOC_RANGES, OUT, LSE, ROW_REF,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vd, stride_vn,
    stride_qsb, stride_qsh, stride_qsm,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm, range_b, range_h, stride_qdb, stride_kdb, stride_drb,
    H, GROUP, NQ, NK, N_BUCKET, DIAGONAL, WINDOW,
    D_QK: tl.constexpr, D_V: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BIAS_MODE: tl.constexpr,
    USE_TMA: tl.constexpr, PERM_P: tl.constexpr, PV_SPLIT: tl.constexpr, CVT_I2F: tl.constexpr,
    EMULATE: tl.constexpr, LIFT: tl.constexpr, EMPTY_ROW: tl.constexpr, SKIP_MASKED: tl.constexpr,
    DOCUMENTS: tl.constexpr = False,
):
    # Causal: the last query tiles carry the most key tiles; launch them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP  # GQA/MQA: read the shared K/V head in place

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_key = _key_permutation(BLOCK_N) if PERM_P else offs_n
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    row_ok = offs_m < NQ

    q_ok = row_ok[:, None]
    if D_QK < HEAD_DIM:
        q_ok = q_ok & (offs_d < D_QK)[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=q_ok, other=0)
    q_scale = tl.load(QS + b * stride_qsb + h * stride_qsh + offs_m * stride_qsm, mask=row_ok, other=0.0)
    row_t = q_scale * 1.4426950408889634  # LOG2E, rounded to float32 like the reference

    k_ptrs = K
    v_ptrs = VT
    if PERM_P or not USE_TMA:
        k_ptrs = K + b * stride_kb + hk * stride_kh + offs_d[:, None] * stride_kd + offs_key[None, :] * stride_kn
    if not USE_TMA:
        v_ptrs = VT + b * stride_vb + hk * stride_vh + offs_dv[:, None] * stride_vd + offs_n[None, :] * stride_vn
    ks_ptr = KS + b * stride_ksb + hk * stride_ksh
    b_ptrs = BIAS + b * stride_bb + h * stride_bh
    if BIAS_MODE == 1:
        b_ptrs = b_ptrs + offs_key * stride_bn
    elif BIAS_MODE == 2:
        # Padded query rows read row 0 instead of running past the bias.
        b_ptrs = b_ptrs + tl.where(row_ok, offs_m, 0)[:, None] * stride_bm + offs_key[None, :] * stride_bn

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], tl.float32)

    # Tiles wholly inside the keys and visible to every row need no mask; the rest (the
    # window's and the diagonal's bands, the tail) do; tiles outside [lo, hi) are skipped.
    lo, full_lo, full_hi, hi = _tile_range(pid_m * BLOCK_M, NK, DIAGONAL, WINDOW, CAUSAL, WINDOWED, BLOCK_M,
                                           BLOCK_N)
    if SKIP_MASKED:
        # A key-row bias: tiles whose keys it masks all (key_bias.tile_ranges) hold no
        # probability and move no row's final maximum, so they are skipped; a row left
        # with none is a row with no visible key, as in the reference.
        lo, hi = key_bias.kept_keys(RANGES + (b * range_b + h * range_h) * 4, lo, hi, BLOCK_N)
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    q_doc = row_ok  # unread without documents
    kd_ptr = KDOC
    if DOCUMENTS:
        # Key tiles outside the rows' documents hold no visible key either: skipped; the
        # tiles whole inside their one document run unmasked.
        q_doc = tl.load(QDOC + b * stride_qdb + offs_m, mask=row_ok, other=-1)
        kd_ptr = KDOC + b * stride_kdb
        lo, full_lo, full_hi, hi = documents.key_range(DOC_RANGES + b * stride_drb, pid_m * BLOCK_M,
                                                       tl.cdiv(NQ, documents.RANGE_ROWS), lo, full_lo, full_hi,
                                                       hi, NK, BLOCK_M)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, row_t, K, VT, k_ptrs, v_ptrs, b_ptrs, ks_ptr, q_doc, kd_ptr, b, hk,
                            offs_m, offs_key, offs_d, offs_dv, lo, full_lo, NK, DIAGONAL, WINDOW, stride_kn,
                            stride_vn, stride_bn, P_MODE, CAUSAL, WINDOWED, BIAS_MODE, DOCUMENTS, True, USE_TMA, PERM_P,
                            PV_SPLIT, CVT_I2F, EMULATE, D_QK, D_V, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, row_t, K, VT, k_ptrs, v_ptrs, b_ptrs, ks_ptr, q_doc, kd_ptr, b, hk,
                            offs_m, offs_key, offs_d, offs_dv, full_lo, full_hi, NK, DIAGONAL, WINDOW, stride_kn,
                            stride_vn, stride_bn, P_MODE, CAUSAL, WINDOWED, BIAS_MODE, DOCUMENTS, False, USE_TMA,
                            PERM_P, PV_SPLIT, CVT_I2F, EMULATE, D_QK, D_V, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, row_t, K, VT, k_ptrs, v_ptrs, b_ptrs, ks_ptr, q_doc, kd_ptr, b, hk,
                            offs_m, offs_key, offs_d, offs_dv, full_hi, hi, NK, DIAGONAL, WINDOW, stride_kn,
                            stride_vn, stride_bn, P_MODE, CAUSAL, WINDOWED, BIAS_MODE, DOCUMENTS, True, USE_TMA, PERM_P,
                            PV_SPLIT, CVT_I2F, EMULATE, D_QK, D_V, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N)

    # A row that saw no visible key (formats.EMPTY_ROW_LOG2): O = 0, LSE = -inf, reference 0.
    empty = m_i < EMPTY_ROW
    v_scale = tl.load(VS + b * stride_vsb + hk * stride_vsh)
    r = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32) * v_scale, l_i)
    out = tl.where(empty[:, None], 0.0, acc * r[:, None])
    o_ok = row_ok[:, None]
    if D_V < HEAD_DIM_V:
        o_ok = o_ok & (offs_dv < D_V)[None, :]
    o_ptrs = OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=o_ok)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i) - LIFT) * 0.6931471805599453)  # LN2
    row = b * stride_lb + h * stride_lh + offs_m * stride_lm
    tl.store(LSE + row, lse, mask=row_ok)
    tl.store(ROW_REF + row, tl.where(empty, 0.0, m_i), mask=row_ok)  # backward rebuilds P against it


# ------------------------------------------------------------------------ launch

# (BLOCK_M, num_warps, num_stages, maxnreg).  BLOCK_M must divide KEY_TILE.  128/8 keeps
# two warpgroups per program in lockstep (one program per SM); 64/4 with a register cap
# fits 2-4 programs per SM, whose softmax and tensor-core phases interleave (Triton gives
# no ping-pong within one program).  Measured in docs/perf-notes/2026-11.md, "Forward
# kernel performance notes", "Versions: prediction → measurement".
CONFIGS = [(128, 8, 2, None), (128, 8, 3, None), (64, 4, 2, None), (64, 4, 2, 168), (64, 4, 3, 168)]
# Measured best on the H200 (the same section, its row "final"); used unless a config is passed or
# FP4ATTN_AUTOTUNE=1.  Causal D=128 favours the two-warpgroup tile from 16k keys on.
_SMALL, _BIG, _D64 = (64, 4, 2, 168), (128, 8, 3, None), (64, 4, 3, 168)


# Tiles of 256 channels: eight warps share the 64-row tile's accumulator (64 registers a
# thread); compiled for sm_90 (benchmarks/inspect_sass.py), not yet timed.
_D256 = (64, 8, 2, None)


def tuned_config(head_dim: int, causal: bool, n: int = 4096):
    """The launch config for a kernel head dim (``formats.kernel_head_dim``)."""
    if head_dim <= 64:
        return _D64
    if head_dim > 128:
        return _D256
    return _BIG if causal and n >= 16384 else _SMALL


def _n_bucket(n: int) -> int:
    """Autotune key: the power of two at or above n, so nearby lengths share a tuning."""
    return 1 << max(n - 1, 1).bit_length()


_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s, maxnreg=r) for bm, w, s, r in CONFIGS],
    key=["N_BUCKET", "D_QK", "D_V", "P_MODE", "CAUSAL", "WINDOWED", "BIAS_MODE", "USE_TMA", "PERM_P", "PV_SPLIT",
         "CVT_I2F", "SKIP_MASKED", "DOCUMENTS"],
)(_fwd_kernel)


def _autotune_enabled() -> bool:
    return os.environ.get("FP4ATTN_AUTOTUNE", "0") == "1"


def _descriptor(t: torch.Tensor, block_shape):
    """A TMA descriptor over a 4-D tensor in place, or None where TMA cannot address it
    (base or a stride not 16-byte aligned, last dim not contiguous)."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return None
    strides = list(t.stride())
    # A size-1 dim's stride is never used; give it a legal (aligned) value.
    for i in range(3):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    if any((st * t.element_size()) % 16 for st in strides[:-1]):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), strides, list(block_shape))


# Gather K rows so that P needs no register shuffles before the P.V wgmma (see
# _key_permutation); costs TMA for K (a permuted row gather is a pointer load).
PERM_P = True
# Switches measured in docs/perf-notes/2026-11.md, "Versions: prediction → measurement"
# (v2).  PV_SPLIT: per-tile P.V in a fresh wgmma
# accumulator added in float32 (10x closer to the reference, same speed); CVT_I2F: the
# INT8 scores converted by I2FP instead of a magic-number add (fewer instructions).
OPTIONS = dict(PV_SPLIT=True, CVT_I2F=True)


def _emulate() -> bool:
    """Under TRITON_INTERPRET=1 (CPU) the PTX-only steps run as float32 arithmetic."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def attention_forward(q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out, lse, row_ref,
                      diagonal=0, window=0, q_documents=None, k_documents=None, config=None, use_tma=None,
                      perm_p=None, options=None):
    """Launch the forward kernel into the preallocated ``out`` [B, H, Nq, Dv] (any strides)
    and ``lse``, ``row_ref`` [B, H, Nq] float32 with equal strides.  ``diagonal`` and
    ``window`` refine ``causal`` (``formats.visible``); ``q_documents`` [B, Nq] and
    ``k_documents`` [B, Nk] are the document structure (``documents.py``).  ``config`` = (BLOCK_M, num_warps,
    num_stages, maxnreg) overrides the default (benchmarks use it);
    ``FP4ATTN_AUTOTUNE=1`` autotunes.  ``use_tma=False`` forces the pointer path (tests
    use it to cover both)."""
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v_t.shape[-2]
    if not (F.supported_head_dim(d) and F.supported_head_dim(dv)) or k.shape[-1] != d:
        raise ValueError(f"head dims {d}/{dv} not supported (multiples of {F.HEAD_DIM_STEP} from "
                         f"{F.MIN_HEAD_DIM} to {F.MAX_HEAD_DIM})")
    if h % hkv:
        raise ValueError(f"{h} query heads not a multiple of {hkv} kv heads")
    if q.dtype != torch.int8 or k.dtype != torch.int8 or v_t.dtype != F.E4M3:
        raise TypeError(f"expected int8 q/k and float8_e4m3fn v_t, got {q.dtype}, {k.dtype}, {v_t.dtype}")
    if window and not causal:
        raise ValueError("a window needs the causal structure")
    if nq == 0:
        return
    if nk == 0:
        raise ValueError("attention over zero keys")
    if row_ref.stride() != lse.stride():
        raise ValueError("lse and row_ref must share strides")
    if max(q.numel(), k.numel(), v_t.numel(), out.numel()) >= 2**31 or b * h >= 65536:
        # 32-bit element offsets; the grid's second dimension holds B * H
        raise ValueError(f"too large for this kernel: B*H={b * h}, {max(q.numel(), out.numel())} elements")
    q_scale, k_scale, v_scale = (s.float() for s in (q_scale, k_scale, v_scale))

    bias_mode, bias_strides, bias_arg = 0, (0, 0, 0, 0), q_scale  # bias_arg never read when mode 0
    skip = None
    if bias is not None:
        bias_arg = bias.float().expand(b, h, nq, nk)
        bias_strides = bias_arg.stride()
        bias_mode = 1 if bias_strides[2] == 0 or nq == 1 else 2
        skip = key_bias.skip_ranges(key_bias.KeyRows.of(bias_arg, b, h, nq, nk), BLOCK_N)  # mode 1 only
    ranges, range_b, range_h = skip or (lse, 0, 0)  # lse: never read without skipping
    q_doc, k_doc, doc_ranges, *doc_strides = documents.launch_args(q_documents, k_documents, BLOCK_N, lse)

    emulate = _emulate()
    head_dim, head_dim_v = F.kernel_head_dim(d), F.kernel_head_dim(dv)
    perm = PERM_P if perm_p is None else perm_p
    k_desc = v_desc = None
    # TMA boxes take whole channel tiles; padded head dims and the interpreter use pointers.
    if use_tma is not False and not emulate and (d, dv) == (head_dim, head_dim_v):
        k_desc = k if perm else _descriptor(k, (1, 1, BLOCK_N, d))
        v_desc = _descriptor(v_t, (1, 1, dv, BLOCK_N))
    tma = k_desc is not None and v_desc is not None
    args = (
        q, k_desc if tma else k, v_desc if tma else v_t, q_scale, k_scale, v_scale, bias_arg, ranges, q_doc, k_doc,
        doc_ranges, out, lse, row_ref,
        *q.stride(), *k.stride(), *v_t.stride(),
        *q_scale.stride(), *k_scale.stride(), *v_scale.stride(),
        *bias_strides, *out.stride(), *lse.stride(), range_b, range_h, *doc_strides,
        h, h // hkv, nq, nk, _n_bucket(max(nq, nk)), diagonal if causal else 0, window if causal else 0,
    )
    meta = dict(D_QK=d, D_V=dv, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_N=BLOCK_N,
                P_MODE=_P_MODE_ID[p_mode], CAUSAL=bool(causal), WINDOWED=bool(causal and window),
                BIAS_MODE=bias_mode, USE_TMA=tma, PERM_P=perm, EMULATE=emulate, LIFT=F.p_lift(p_mode),
                EMPTY_ROW=F.EMPTY_ROW_LOG2, SKIP_MASKED=skip is not None, DOCUMENTS=q_documents is not None,
                **OPTIONS)
    meta.update(options or {})
    if config is None and _autotune_enabled():
        grid = lambda META: (triton.cdiv(nq, META["BLOCK_M"]), b * h)  # noqa: E731
        _tuned[grid](*args, **meta)
        return
    block_m, warps, stages, maxnreg = config or tuned_config(max(head_dim, head_dim_v), causal, max(nq, nk))
    assert F.KEY_TILE % block_m == 0
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    _fwd_kernel[(triton.cdiv(nq, block_m), b * h)](*args, **meta, BLOCK_M=block_m, num_warps=warps,
                                                    num_stages=stages, **extra)
