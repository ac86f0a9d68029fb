"""Hopper (sm_90) backward attention in Triton: INT8 score recompute, FP8 gradient products.

Computes what ``reference.attention_backward`` specifies.  Per tile of 128 keys (a K scale
block) and 64 queries (dK/dV at D = 64: 128, ``formats.ds_block_dk``):
  x = int8 q.k * (q_scale * log2e * k_scale) [+ bias], masked     (exact int32 products)
  p = formats.probability_operand(x, r)  (r: the forward's row reference; bit-identical codes)
  dP = (E5M2 dO . E4M3 V^T) * do_scale * v_scale
  dS = p * (dP - delta) -> E4M3 with an amax scale per key (dK/dV kernel,
       ``formats.ds_block_dk``) or per query (dQ kernel, ``formats.DS_BLOCK_DQ``)
  dV += (E4M3 P^T . E5M2 dO) * do_scale,  dK += (E4M3 dS^T . E4M3 Qe) * ds_scale_key * qe_scale,
  dQ += (E4M3 dS . E4M3 Ke) * ds_scale_query * ke_scale
Each tile's scales multiply its partial product before it joins the fp32 accumulator.

Work split (FlashAttention-2 style, two kernels, no atomics):
- ``_bwd_dkdv_kernel``: one program per (key tile, batch * kv head); dK and dV stay in
  registers while it walks the query heads of its GQA group and the query tiles (causal:
  only tiles at or below the diagonal).
- ``_bwd_dq_kernel``: one program per (query tile, batch * head) walking the key tiles.
The dQ kernel recomputes S and dP (two of the five products again) instead of adding dQ
with fp32 atomics: no zeroed fp32 workspace, no conversion pass, deterministic results,
and lower register pressure than holding dK, dV and a dQ tile at once.  Both kernels
compute a tile with the same helper; each quantizes the dS it computes with its own
scale blocks, per key for dK and per query for dQ (as the reference specifies).  Each
launch (``dkdv_backward``, ``dq_backward``) reads the call's operands as
``attention_bwd_prep.prepare`` made them, once for both; ``kernels.backward_kernel``
chooses per direction between these kernels and the Gluon ones
(``kernels/gluon/attention_bwd_dq.py``, ``attention_bwd_dkdv.py``: the same numbers).

Tiles are computed transposed ([keys, queries]) so that P^T and dS^T, the A operands of
dV and dK, come straight from registers; the products contracted over tokens read
token-major copies (``attention_bwd_prep``).

Numerics that are not bit for bit the reference's:
- Hopper's FP8 tensor cores do not accumulate in full float32: measured on the H200,
  every 8-bit float product here (dP, dV, dQ, dK) lands ~1-2e-4 rel-L2 from its float32
  value (the INT8 score product is exact, so P codes stay bit-identical).  dS codes then
  differ from the reference's where dS sits within that error of an E4M3 midpoint.
  ``OPTIONS["MIXED_F16"]`` runs dP and dV with fp16 operands instead (E4M3 and E5M2
  values are exact in fp16; measured ~2e-7) at half the tensor-core rate;
- otherwise float32 sums run in tensor-core order, and the scales multiply the rows of
  tile products instead of every element;
- the E4M3 dS code is the rounding of ``dS * (1 / scale)`` instead of ``dS / scale``
  (one float32 rounding apart);
- ``p_mode="exp"`` uses the GPU's exp2 (as the forward kernel does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import formats as F
from . import documents, key_bias
from .attention_bwd_prep import BackwardOperands, prepare
from .common import e2m1_round, e4m3_code_value, e4m3_round, max_propagate_nan, mul_rn

_P_MODE_ID = {"direct": 0, "exp": 1, "fp4": 2}
# Key tile = K scale block = the keys of one dQ dS scale; the dK/dV kernel's query tile =
# the queries of one dK dS scale (formats.ds_block_dk, dividing the Qe scale block).  Each
# dS scale is a row factor of its product.
BLOCK_N = F.KEY_TILE
BLOCK_M_DQ = 64
DS_SCALE_MIN = tl.constexpr(F.DS_SCALE_MIN)
assert F.DS_BLOCK_DQ == (1, BLOCK_N)
assert BLOCK_N == F.KEY_TILE == F.SCALE_BLOCK == 128
assert all(F.SCALE_BLOCK % F.ds_block_dk(d)[0] == 0 and F.ds_block_dk(d)[1] == 1
           for d in range(F.MIN_HEAD_DIM, F.MAX_HEAD_DIM + 1, F.HEAD_DIM_STEP))


@triton.jit
def _to_operand(y, EMULATE: tl.constexpr):
    """E4M3 operand from float32 values already inside [-448, 448]."""
    if EMULATE:
        return e4m3_round(y)
    else:
        return y.to(tl.float8e4nv)


@triton.jit
def _probability_t(x, x_scale, r, P_MODE: tl.constexpr, EMULATE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """E4M3 P operand of a transposed tile: log2 scores x * x_scale [keys, queries], ``r``
    [queries] integer row references (formats.probability_operand, keys along axis 0).
    Direct-P takes x = s, the integer scores, with x_scale = t (the product folded into
    its FMA, unrounded), or the log2 scores with x_scale = 1; the other modes take the log2
    scores (x_scale unused)."""
    if P_MODE == 0:
        # code = rne(clamp(8 x + 120 - 8 r, 0, 126)), one rounding (an FMA of x * 8 t), as
        # the reference's.  c + 2**23 leaves rne(c) in the low mantissa byte.  A masked
        # score of a padded query (-inf times t = 0) is NaN here: the maximum, which does
        # not propagate NaN, makes it 0, code 0 (a NaN-propagating clamp would give 0xFF).
        c = tl.minimum(tl.maximum(tl.fma(x, x_scale * 8.0, (120.0 - 8.0 * r)[None, :]), 0.0), 126.0)
        code = (c + 8388608.0).to(tl.int32, bitcast=True) & 0xFF
        if EMULATE:
            p = e4m3_code_value(code)
        else:
            p = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    elif P_MODE == 1:
        p = _to_operand(tl.math.exp2(x - r[None, :] + 8.0), EMULATE)
    else:
        FP4_BLOCK: tl.constexpr = 32
        rel = tl.reshape(x - r[None, :], (BLOCK_N // FP4_BLOCK, FP4_BLOCK, BLOCK_M))
        e = tl.math.ceil(tl.reduce(rel, 1, max_propagate_nan))
        live = e > float("-inf")
        e = tl.where(live, e, 0.0)
        xc = rel - e[:, None, :] + 2.584962500721156  # log2(6)
        ax = mul_rn(xc, 1.5, EMULATE)  # the reference rounds a * xc before + b
        q = e2m1_round(tl.maximum(ax + 1.2, 0.0))
        q = tl.where(live[:, None, :] & (rel > float("-inf")), q, 0.0)
        # 2**(e + 6) from its exponent bits (0 below 2**-126, where E4M3 rounds to 0 anyway)
        scale = (tl.maximum(e.to(tl.int32) + (127 + 6), 0) << 23).to(tl.float32, bitcast=True)
        p = _to_operand(tl.reshape(q * scale[:, None, :], (BLOCK_N, BLOCK_M)), EMULATE)
    return p


@triton.jit
def _tile(k, v, q, do, row_t, r, delta, k_scale, dov_scale, bias, q_doc, k_doc, offs_m, offs_n, NQ, NK, DIAGONAL,
          WINDOW, P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BIAS_MODE: tl.constexpr,
          DOCUMENTS: tl.constexpr, EMULATE: tl.constexpr,
          MIXED_F16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PER_KEY: tl.constexpr):
    """One transposed tile: P^T and dS^T codes [keys, queries] and the dS scales, one per
    key ([keys], PER_KEY: the dK product's) or one per query ([queries]: the dQ product's).

    k, v: [keys, D] INT8 / E4M3; q, do: [queries, D] INT8 / E5M2; row_t = q_scale * log2e,
    r (the forward's integer row reference), delta: [queries]; dov_scale = do_scale * v_scale;
    bias: [keys] float32 (BIAS_MODE 1, a key-row bias) or the tile's pointers (2, dense);
    q_doc [queries], k_doc [keys]: document ids (DOCUMENTS)."""
    s = tl.dot(k, tl.trans(q), out_dtype=tl.int32)
    s = (s + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0  # exact: |s| < 2**22
    t = row_t * k_scale  # rounded as the reference's row * col
    ok = (offs_n < NK)[:, None] & (offs_m < NQ)[None, :]
    if BIAS_MODE == 1:
        x = tl.fma(s, t[None, :], bias[:, None])
        x_scale = 1.0
    elif BIAS_MODE == 2:
        x = tl.fma(s, t[None, :], tl.load(bias, mask=ok, other=0.0))
        x_scale = 1.0
    elif P_MODE == 0:  # Direct-P folds the product into its FMA (reference.log2_scores)
        x = s
        x_scale = t[None, :]
    else:
        x = s * t[None, :]
        x_scale = 1.0
    if CAUSAL:  # formats.visible
        ok = ok & (offs_n[:, None] <= offs_m[None, :] + DIAGONAL)
        if WINDOWED:
            ok = ok & (offs_n[:, None] > offs_m[None, :] + (DIAGONAL - WINDOW))
    if DOCUMENTS:
        ok = ok & (k_doc[:, None] == q_doc[None, :])
    x = tl.where(ok, x, float("-inf"))
    p = _probability_t(x, x_scale, r, P_MODE, EMULATE, BLOCK_N, BLOCK_M)

    if MIXED_F16:  # E4M3 x E5M2 products are exact in fp16 too (half the tensor-core rate)
        dp = tl.dot(v.to(tl.float16), tl.trans(do.to(tl.float16))) * dov_scale
    else:
        dp = tl.dot(v, tl.trans(do)) * dov_scale
    ds = p.to(tl.float32) * (dp - delta[None, :])
    if PER_KEY:
        amax = tl.max(tl.abs(ds), 1)
    else:
        amax = tl.max(tl.abs(ds), 0)
    ds_scale = tl.math.div_rn(amax, 448.0)
    ds_scale = tl.where(ds_scale < DS_SCALE_MIN, DS_SCALE_MIN, ds_scale)  # formats.quantize_ds
    inv = tl.math.div_rn(1.0, ds_scale)
    if PER_KEY:
        inv = inv[:, None]
    else:
        inv = inv[None, :]
    # A NaN element stays NaN, as the Gluon kernels' saturating cvt keeps it.
    ds8 = _to_operand(tl.clamp(ds * inv, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL), EMULATE)
    return p, ds8, ds_scale, dp


# Scalars that index scales and rows or count heads and tokens: specialising on their
# divisibility would only multiply compiled variants.
_NO_SPECIALIZE = ["stride_dsb", "stride_dsh", "stride_dlb", "stride_dlh", "stride_dlm",
                  "stride_qsb", "stride_qsh", "stride_qsm", "stride_ksb", "stride_ksh", "stride_ksn",
                  "stride_vsb", "stride_vsh", "stride_qesb", "stride_qesh", "stride_qesm",
                  "stride_kesb", "stride_kesh", "stride_kesn", "stride_rb", "stride_rh", "stride_rm",
                  "stride_bb", "stride_bh", "stride_bm", "stride_bn", "H", "HKV", "GROUP", "NQ", "NK",
                  "DIAGONAL", "WINDOW", "range_b", "range_h", "stride_qdb", "stride_kdb", "stride_drb"]


@triton.jit
def _rows(X, b, h, offs, n_ok, stride_b, stride_h, stride_n, stride_d, D: tl.constexpr, HEAD_DIM: tl.constexpr,
          other):
    """Rows ``offs`` [R] of head (b, h) of a [B, H, N, D] tensor as an [R, HEAD_DIM] tile,
    ``other`` past N and in the padding channels past D."""
    offs_d = tl.arange(0, HEAD_DIM)
    ok = n_ok[:, None]
    if D < HEAD_DIM:
        ok = ok & (offs_d < D)[None, :]
    return tl.load(X + b * stride_b + h * stride_h + offs[:, None] * stride_n + offs_d[None, :] * stride_d,
                   mask=ok, other=other)


@triton.jit
def _columns(X, b, h, offs, n_ok, stride_b, stride_h, stride_d, stride_n, D: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    """Columns ``offs`` [C] of head (b, h) of a token-major [B, H, D, N] tensor as a
    [HEAD_DIM, C] tile, zero past N and in the padding channels."""
    offs_d = tl.arange(0, HEAD_DIM)
    ok = n_ok[None, :]
    if D < HEAD_DIM:
        ok = ok & (offs_d < D)[:, None]
    return tl.load(X + b * stride_b + h * stride_h + offs_d[:, None] * stride_d + offs[None, :] * stride_n,
                   mask=ok, other=0.0)


@triton.jit
def _store_rows(X, b, h, offs, n_ok, stride_b, stride_h, stride_n, stride_d, values, D: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    ok = n_ok[:, None]
    if D < HEAD_DIM:
        ok = ok & (offs_d < D)[None, :]
    tl.store(X + b * stride_b + h * stride_h + offs[:, None] * stride_n + offs_d[None, :] * stride_d,
             values.to(X.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_dkdv_kernel(
    DO, DOT, DOS, DELTA, Q, K, V, QS, KS, VS, QET, QES, BIAS, RANGES, QDOC, KDOC, DOC_RANGES, ROW_REF, DK, DV, DBG_P,
    DBG_DP,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dtb, stride_dth, stride_dtd, stride_dtm,
    stride_dsb, stride_dsh,
    stride_dlb, stride_dlh, stride_dlm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_qsb, stride_qsh, stride_qsm,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh,
    stride_qtb, stride_qth, stride_qtd, stride_qtm,
    stride_qesb, stride_qesh, stride_qesm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_rb, stride_rh, stride_rm,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    range_b, range_h, stride_qdb, stride_kdb, stride_drb, H, HKV, GROUP, NQ, NK, DIAGONAL, WINDOW,
    D_QK: tl.constexpr, D_V: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BIAS_MODE: tl.constexpr,
    EMULATE: tl.constexpr, DEBUG: tl.constexpr, SKIP_MASKED: tl.constexpr, DOCUMENTS: tl.constexpr,
    MIXED_F16: tl.constexpr = False,
):
    pid_n = tl.program_id(0)  # causal: low key tiles see the most queries and go first
    bhk = tl.program_id(1)
    b = bhk // HKV
    hk = bhk % HKV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    n_ok = offs_n < NK

    k = _rows(K, b, hk, offs_n, n_ok, stride_kb, stride_kh, stride_kn, stride_kd, D_QK, HEAD_DIM, 0)
    v = _rows(V, b, hk, offs_n, n_ok, stride_vb, stride_vh, stride_vn, stride_vd, D_V, HEAD_DIM_V, 0.0)
    if EMULATE:
        v = v.to(tl.float32)
    k_scale = tl.load(KS + b * stride_ksb + hk * stride_ksh + pid_n * stride_ksn)
    v_scale = tl.load(VS + b * stride_vsb + hk * stride_vsh)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], tl.float32)
    # Causal (formats.visible): query i sees key j iff i >= j - DIAGONAL (and, windowed,
    # i < j - DIAGONAL + WINDOW); query tiles outside that range hold only -inf.  Tiles
    # start at multiples of BLOCK_M, the dK dS scale blocks'.
    lo = 0
    hi = NQ
    if CAUSAL:
        lo = (tl.maximum(start_n - DIAGONAL, 0) // BLOCK_M) * BLOCK_M
        if WINDOWED:
            hi = tl.minimum(NQ, tl.maximum(start_n + BLOCK_N - 1 - DIAGONAL + WINDOW, 0))
    k_doc = n_ok  # unread without documents
    if DOCUMENTS:  # query tiles outside this key tile's documents hold P = 0
        k_doc = tl.load(KDOC + b * stride_kdb + offs_n, mask=n_ok, other=-1)
        lo, hi = documents.query_range(DOC_RANGES + b * stride_drb + pid_n * 2, lo, hi, BLOCK_M)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        do_scale = tl.load(DOS + b * stride_dsb + h * stride_dsh)
        dov_scale = do_scale * v_scale
        hi_h = hi
        bias = BIAS + b * stride_bb + h * stride_bh
        if BIAS_MODE == 1:  # this key tile's biases, the same for every query: loaded once
            bias = tl.load(bias + offs_n * stride_bn, mask=n_ok, other=0.0)
        if SKIP_MASKED:  # a key tile a key-row bias masks wholly: P = 0, no dK or dV from this head
            ranges = RANGES + (b * range_b + h * range_h) * 4
            hi_h = tl.where((pid_n >= tl.load(ranges)) & (pid_n < tl.load(ranges + 1)), hi, lo)
        for start_m in range(lo, hi_h, BLOCK_M):
            offs_m = start_m + offs_mb
            m_ok = offs_m < NQ
            q = _rows(Q, b, h, offs_m, m_ok, stride_qb, stride_qh, stride_qm, stride_qd, D_QK, HEAD_DIM, 0)
            do = _rows(DO, b, h, offs_m, m_ok, stride_dob, stride_doh, stride_dom, stride_dod, D_V, HEAD_DIM_V, 0.0)
            row_t = tl.load(QS + b * stride_qsb + h * stride_qsh + offs_m * stride_qsm, mask=m_ok,
                            other=0.0) * 1.4426950408889634
            r = tl.load(ROW_REF + b * stride_rb + h * stride_rh + offs_m * stride_rm, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + b * stride_dlb + h * stride_dlh + offs_m * stride_dlm, mask=m_ok, other=0.0)
            tile_bias = bias
            if BIAS_MODE == 2:
                tile_bias = bias + offs_m[None, :] * stride_bm + offs_n[:, None] * stride_bn
            if EMULATE:
                do = do.to(tl.float32)
            q_doc = m_ok
            if DOCUMENTS:
                q_doc = tl.load(QDOC + b * stride_qdb + offs_m, mask=m_ok, other=-1)
            p, ds, ds_scale, dp = _tile(k, v, q, do, row_t, r, delta, k_scale, dov_scale, tile_bias, q_doc, k_doc,
                                        offs_m, offs_n, NQ, NK, DIAGONAL, WINDOW, P_MODE, CAUSAL, WINDOWED, BIAS_MODE,
                                        DOCUMENTS, EMULATE, MIXED_F16, BLOCK_N, BLOCK_M, True)

            do_t = _columns(DOT, b, h, offs_m, m_ok, stride_dtb, stride_dth, stride_dtd, stride_dtm, D_V, HEAD_DIM_V)
            qe_t = _columns(QET, b, h, offs_m, m_ok, stride_qtb, stride_qth, stride_qtd, stride_qtm, D_QK, HEAD_DIM)
            if EMULATE:
                do_t = do_t.to(tl.float32)
                qe_t = qe_t.to(tl.float32)
            qe_scale = tl.load(QES + b * stride_qesb + h * stride_qesh + (start_m // BLOCK_N) * stride_qesm)
            if MIXED_F16:
                dv += tl.dot(p.to(tl.float16), tl.trans(do_t.to(tl.float16))) * do_scale
            else:
                dv += tl.dot(p, tl.trans(do_t)) * do_scale
            dk += tl.dot(ds, tl.trans(qe_t)) * (ds_scale[:, None] * qe_scale)
            if DEBUG:  # P and dP, [B, H, Nq, Nk] float32 (tests only)
                dbg = b * H * NQ * NK + h * NQ * NK + offs_m[None, :] * NK + offs_n[:, None]
                dbg_ok = n_ok[:, None] & m_ok[None, :]
                tl.store(DBG_P + dbg, p.to(tl.float32), mask=dbg_ok)
                tl.store(DBG_DP + dbg, dp, mask=dbg_ok)

    _store_rows(DK, b, hk, offs_n, n_ok, stride_dkb, stride_dkh, stride_dkn, stride_dkd, dk, D_QK, HEAD_DIM)
    _store_rows(DV, b, hk, offs_n, n_ok, stride_dvb, stride_dvh, stride_dvn, stride_dvd, dv, D_V, HEAD_DIM_V)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_dq_kernel(
    DO, DOS, DELTA, Q, K, V, QS, KS, VS, KET, KES, BIAS, RANGES, QDOC, KDOC, DOC_RANGES, ROW_REF, DQ, DBG_DS,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dsb, stride_dsh,
    stride_dlb, stride_dlh, stride_dlm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_qsb, stride_qsh, stride_qsm,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh,
    stride_ktb, stride_kth, stride_ktd, stride_ktn,
    stride_kesb, stride_kesh, stride_kesn,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_rb, stride_rh, stride_rm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    range_b, range_h, stride_qdb, stride_kdb, stride_drb, H, HKV, GROUP, NQ, NK, DIAGONAL, WINDOW,
    D_QK: tl.constexpr, D_V: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BIAS_MODE: tl.constexpr,
    EMULATE: tl.constexpr, DEBUG: tl.constexpr, SKIP_MASKED: tl.constexpr, DOCUMENTS: tl.constexpr,
    MIXED_F16: tl.constexpr = False,
):
    # Causal: the last query tiles walk the most key tiles; launch them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP  # GQA/MQA: the shared K/V head, read in place
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    m_ok = offs_m < NQ

    q = _rows(Q, b, h, offs_m, m_ok, stride_qb, stride_qh, stride_qm, stride_qd, D_QK, HEAD_DIM, 0)
    do = _rows(DO, b, h, offs_m, m_ok, stride_dob, stride_doh, stride_dom, stride_dod, D_V, HEAD_DIM_V, 0.0)
    if EMULATE:
        do = do.to(tl.float32)
    row_t = tl.load(QS + b * stride_qsb + h * stride_qsh + offs_m * stride_qsm, mask=m_ok, other=0.0) * 1.4426950408889634
    r = tl.load(ROW_REF + b * stride_rb + h * stride_rh + offs_m * stride_rm, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + b * stride_dlb + h * stride_dlh + offs_m * stride_dlm, mask=m_ok, other=0.0)
    do_scale = tl.load(DOS + b * stride_dsb + h * stride_dsh)
    v_scale = tl.load(VS + b * stride_vsb + hk * stride_vsh)
    dov_scale = do_scale * v_scale

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Key tiles holding a key visible to one of these queries (formats.visible).
    lo = 0
    hi = NK
    if CAUSAL:
        hi = tl.minimum(NK, tl.maximum(start_m + BLOCK_M + DIAGONAL, 0))
        if WINDOWED:
            lo = (tl.maximum(start_m + 1 + DIAGONAL - WINDOW, 0) // BLOCK_N) * BLOCK_N
    if SKIP_MASKED:  # the key tiles a key-row bias masks wholly hold dS = 0
        lo, hi = key_bias.kept_keys(RANGES + (b * range_b + h * range_h) * 4, lo, hi, BLOCK_N)
    q_doc = m_ok  # unread without documents
    if DOCUMENTS:  # and so do those outside these queries' documents
        q_doc = tl.load(QDOC + b * stride_qdb + offs_m, mask=m_ok, other=-1)
        lo, _, _, hi = documents.key_range(DOC_RANGES + b * stride_drb, start_m, tl.cdiv(NQ, documents.RANGE_ROWS),
                                           lo, lo, lo, hi, NK, BLOCK_M)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        n_ok = offs_n < NK
        k = _rows(K, b, hk, offs_n, n_ok, stride_kb, stride_kh, stride_kn, stride_kd, D_QK, HEAD_DIM, 0)
        v = _rows(V, b, hk, offs_n, n_ok, stride_vb, stride_vh, stride_vn, stride_vd, D_V, HEAD_DIM_V, 0.0)
        if EMULATE:
            v = v.to(tl.float32)
        k_scale = tl.load(KS + b * stride_ksb + hk * stride_ksh + (start_n // BLOCK_N) * stride_ksn)
        bias = BIAS + b * stride_bb + h * stride_bh
        if BIAS_MODE == 1:  # a key-row bias: the tile's keys only
            bias = tl.load(bias + offs_n * stride_bn, mask=n_ok, other=0.0)
        elif BIAS_MODE == 2:
            bias = bias + offs_m[None, :] * stride_bm + offs_n[:, None] * stride_bn
        k_doc = n_ok
        if DOCUMENTS:
            k_doc = tl.load(KDOC + b * stride_kdb + offs_n, mask=n_ok, other=-1)
        p, ds, ds_scale, dp = _tile(k, v, q, do, row_t, r, delta, k_scale, dov_scale, bias, q_doc, k_doc, offs_m,
                                    offs_n, NQ, NK, DIAGONAL, WINDOW, P_MODE, CAUSAL, WINDOWED, BIAS_MODE, DOCUMENTS,
                                    EMULATE, MIXED_F16, BLOCK_N, BLOCK_M, False)
        ke_t = _columns(KET, b, hk, offs_n, n_ok, stride_ktb, stride_kth, stride_ktd, stride_ktn, D_QK, HEAD_DIM)
        if EMULATE:
            ke_t = ke_t.to(tl.float32)
        ke_scale = tl.load(KES + b * stride_kesb + hk * stride_kesh + (start_n // BLOCK_N) * stride_kesn)
        dq += tl.dot(tl.trans(ds), tl.trans(ke_t)) * (ds_scale[:, None] * ke_scale)
        if DEBUG:
            dbg = b * H * NQ * NK + h * NQ * NK + offs_m[None, :] * NK + offs_n[:, None]
            tl.store(DBG_DS + dbg, ds.to(tl.float32) * ds_scale[None, :], mask=n_ok[:, None] & m_ok[None, :])

    _store_rows(DQ, b, h, offs_m, m_ok, stride_dqb, stride_dqh, stride_dqm, stride_dqd, dq, D_QK, HEAD_DIM)


# ------------------------------------------------------------------------ launch

# (num_warps, num_stages) per kernel: 8 warps = two warpgroups over the dK/dV kernel's
# 128-key tile, whose dK/dV accumulators alone take 2 * 128 * D fp32 (both kernels still
# spill at 255 registers).  One stage measured faster than two on the H200 (fewer
# spills): 5.9 vs 7.0 ms for both kernels at B=4, H=16, N=4096, D=128 causal, with
# 128-query dQ tiles (64-query: dQ 2.35 vs 2.29 ms, docs/perf-notes/2026-11.md, "Training (bench_attention.py
# --training", "Run 2").
CONFIG = {"dkdv": (8, 1), "dq": (8, 1)}
# MIXED_F16: run the E4M3 x E5M2 products (dP, dV) as fp16 x fp16 (exact, same numbers).
OPTIONS = dict(MIXED_F16=False)


def dkdv_backward(ops: BackwardOperands, dk, dv, config=None, debug=None, options=None) -> None:
    """dK and dV by ``_bwd_dkdv_kernel`` into ``dk``, ``dv`` [B, Hkv, Nk, D] (any strides).
    ``debug`` = (p, dp): float32 [B, H, Nq, Nk] buffers receiving its P and dP (scaled)."""
    b, h, nq, _ = ops.q.shape
    hkv, nk = ops.k.shape[1], ops.k.shape[2]
    p_dump, dp_dump = debug if debug is not None else (ops.row_ref,) * 2
    query_docs = documents.launch_args(ops.q_documents, ops.k_documents, BLOCK_N, ops.row_ref, query_ranges=True)
    warps, stages = dict(CONFIG, **(config or {}))["dkdv"]
    bias, bias_strides, ranges, range_rows = _bias_args(ops)
    _bwd_dkdv_kernel[(triton.cdiv(nk, BLOCK_N), b * hkv)](
        ops.do, ops.do_t, ops.do_scale, ops.delta, ops.q, ops.k, ops.v, ops.q_scale, ops.k_scale, ops.v_scale,
        ops.qe_t, ops.qe_scale, bias, ranges, *query_docs[:3], ops.row_ref, dk, dv, p_dump, dp_dump,
        *ops.do.stride(), *ops.do_t.stride(), *ops.do_scale.stride(), *ops.delta.stride(), *ops.q.stride(),
        *ops.k.stride(), *ops.v.stride(), *ops.q_scale.stride(), *ops.k_scale.stride(), *ops.v_scale.stride(),
        *ops.qe_t.stride(), *ops.qe_scale.stride(), *bias_strides, *ops.row_ref.stride(), *dk.stride(), *dv.stride(),
        *range_rows, *query_docs[3:], h, hkv, h // hkv, nq, nk, *_structure(ops),
        BLOCK_M=F.ds_block_dk(ops.q.shape[-1])[0], **_constexprs(ops, debug, options),
        num_warps=warps, num_stages=stages,
    )


def dq_backward(ops: BackwardOperands, dq, config=None, debug=None, options=None) -> None:
    """dQ by ``_bwd_dq_kernel`` into ``dq`` [B, H, Nq, D] (any strides).  ``debug``: a
    float32 [B, H, Nq, Nk] buffer receiving its dequantized dS."""
    b, h, nq, _ = ops.q.shape
    hkv, nk = ops.k.shape[1], ops.k.shape[2]
    key_docs = documents.launch_args(ops.q_documents, ops.k_documents, BLOCK_N, ops.row_ref)
    warps, stages = dict(CONFIG, **(config or {}))["dq"]
    bias, bias_strides, ranges, range_rows = _bias_args(ops)
    _bwd_dq_kernel[(triton.cdiv(nq, BLOCK_M_DQ), b * h)](
        ops.do, ops.do_scale, ops.delta, ops.q, ops.k, ops.v, ops.q_scale, ops.k_scale, ops.v_scale, ops.ke_t,
        ops.ke_scale, bias, ranges, *key_docs[:3], ops.row_ref, dq, ops.row_ref if debug is None else debug,
        *ops.do.stride(), *ops.do_scale.stride(), *ops.delta.stride(), *ops.q.stride(), *ops.k.stride(),
        *ops.v.stride(), *ops.q_scale.stride(), *ops.k_scale.stride(), *ops.v_scale.stride(), *ops.ke_t.stride(),
        *ops.ke_scale.stride(), *bias_strides, *ops.row_ref.stride(), *dq.stride(),
        *range_rows, *key_docs[3:], h, hkv, h // hkv, nq, nk, *_structure(ops), BLOCK_M=BLOCK_M_DQ,
        **_constexprs(ops, debug, options),
        num_warps=warps, num_stages=stages,
    )


def _bias_args(ops: BackwardOperands):
    """Both kernels' bias and its strides, and the skip ranges with their (row_b, row_h);
    ``row_ref`` stands for a tensor the call does not have (never read)."""
    ranges, range_b, range_h = ops.skip or (ops.row_ref, 0, 0)
    if ops.bias is None:
        return ops.row_ref, (0, 0, 0, 0), ranges, (range_b, range_h)
    return ops.bias, ops.bias.stride(), ranges, (range_b, range_h)


def _structure(ops: BackwardOperands) -> tuple[int, int]:
    return (ops.diagonal if ops.causal else 0, ops.window if ops.causal else 0)


def _constexprs(ops: BackwardOperands, debug, options) -> dict:
    d, dv, nq = ops.q.shape[-1], ops.v.shape[-1], ops.q.shape[2]
    bias_mode = 0 if ops.bias is None else 1 if ops.bias.stride(2) == 0 or nq == 1 else 2  # as the forward's
    return dict(D_QK=d, D_V=dv, HEAD_DIM=F.kernel_head_dim(d), HEAD_DIM_V=F.kernel_head_dim(dv), BLOCK_N=BLOCK_N,
                P_MODE=_P_MODE_ID[ops.p_mode], CAUSAL=ops.causal, WINDOWED=bool(ops.causal and ops.window),
                BIAS_MODE=bias_mode, EMULATE=ops.emulate, DEBUG=debug is not None, SKIP_MASKED=ops.skip is not None,
                DOCUMENTS=ops.q_documents is not None, **OPTIONS) | (options or {})


def attention_backward(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale,
                       bias, row_ref, causal, p_mode, dq, dk, dv, diagonal=0, window=0, q_documents=None,
                       k_documents=None, config=None, debug=None, emulate=None, options=None):
    """Both Triton kernels into the preallocated ``dq`` [B, H, Nq, D], ``dk`` [B, Hkv, Nk, D]
    and ``dv`` [B, Hkv, Nk, Dv] (any strides); arguments as ``reference.attention_backward``
    (``kernels.backward_kernel`` runs the Gluon kernels where they apply).
    ``config`` overrides CONFIG; ``debug`` = (p, dp, ds) float32 [B, H, Nq, Nk] buffers
    receive the dK/dV kernel's P and dP (scaled) and the dQ kernel's dequantized dS
    (tests; the dK/dV kernel's dS follows from its P and dP).  ``emulate=True`` runs the
    float32 emulation of the 8-bit products (as under the interpreter) to tell a
    lowering problem from a formula one."""
    ops = prepare(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, bias,
                  row_ref, causal, p_mode, dk, dv, diagonal, window, q_documents, k_documents, emulate)
    if ops is None:
        return
    if debug is not None:
        assert len(debug) == 3 and all(t.is_contiguous() and t.shape == (*q.shape[:3], k.shape[2])
                                       and t.dtype == torch.float32 for t in debug)
    dkdv_backward(ops, dk, dv, config, None if debug is None else debug[:2], options)
    dq_backward(ops, dq, config, None if debug is None else debug[2], options)
