"""Hopper quantization of Q, K and V for the forward op: two launches, no atomics.

Computes ``formats.quantize_q``, ``quantize_k`` and ``quantize_v(fmt="fp8")``:

1. ``_stats``: per (batch, KV head, chunk of tokens) the absolute maximum of V (for its
   per-head scale), as partials, and per head K's smoothing mean, over
   ``formats.K_MEAN_SAMPLES`` tokens spread over the sequence.
2. ``_quantize``: programs of three kinds, each on one small tile: V rows (E4M3 with the
   head's scale, stored K-major), one 128-token K block (smoothed INT8, one scale), Q rows
   (INT8, a scale per token).  V programs reduce the partials in a fixed order, so the
   result is deterministic; they run first, on the tokens ``_stats`` read last, which
   L2 may still hold.

Bytes: Q and K read once, V twice, the 8-bit codes written once.  Values are scaled as
``formats._per_scale`` does (an IEEE reciprocal per scale, then a multiplication) and
rounded to nearest even; only K's mean is summed in another order, so a K code can
differ from the formats one by one step when its scaled value lies within float32
rounding of a half-integer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ... import formats as F
from .common import e4m3_round, max_propagate_nan

# Tile rows per program and warps: the fastest of benchmarks/lab/explore_quantize.py's
# variants on the H200 (123 us against 144 at 8 warps with 16/32-row tiles, B 4, H 16, N 4k,
# D 128).  Module variables, so that the benchmark can sweep them.
_Q_ROWS, _K_TILE, _V_ROWS = 32, 16, 64
_WARPS = 4
_STATS_TILE, _STATS_WARPS, _STATS_STAGES = 32, 4, 1


@triton.jit
def _tile_of(pid, N, HEADS, ROWS: tl.constexpr):
    """(head index b * HEADS + h, tile index, b, h) of program ``pid`` among the tiles of
    ROWS tokens of every head."""
    tiles = tl.cdiv(N, ROWS)
    bh = pid // tiles
    return bh, pid % tiles, (bh // HEADS).to(tl.int64), (bh % HEADS).to(tl.int64)


@triton.jit
def _in_bounds(rows, N, D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows below N, channels below D, of a [rows, HEAD_DIM] tile (HEAD_DIM: D's power of two)."""
    ok = rows[:, None] < N
    if D < HEAD_DIM:
        ok = ok & (tl.arange(0, HEAD_DIM) < D)[None, :]
    return ok


@triton.jit
def _load_rows(X, b, h, rows, N, stride_b, stride_h, stride_n, stride_d, D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``rows`` of head (b, h) of a ``[B, H, N, D]`` view as float32, zero past N and
    in the padding channels."""
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = X + b * stride_b + h * stride_h + rows[:, None].to(tl.int64) * stride_n + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=_in_bounds(rows, N, D, HEAD_DIM), other=0.0).to(tl.float32)


@triton.jit
def _store_rows(OUT, bh, rows, N, values, D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``rows`` of head ``bh`` of a contiguous ``[B * H, N, D]`` output."""
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(OUT + (bh.to(tl.int64) * N + rows[:, None]) * D + offs_d[None, :], values,
             mask=_in_bounds(rows, N, D, HEAD_DIM))


@triton.jit
def _stats(K, V, KMEAN, VMAX, N, CHUNK, HKV,
           stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
           D_QK: tl.constexpr, D_V: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
           TILE: tl.constexpr, SAMPLES: tl.constexpr, SAMPLE_TILE: tl.constexpr):
    # Per head: programs 0 .. chunks - 1 the partial amax of V over a chunk of tokens; the
    # last one K's smoothing mean (formats.smooth_k: of the tokens i * N // S, i < S =
    # min(N, SAMPLES)).  Heads vary fastest: the last V programs read the last chunk of
    # every head's V, which the V programs of _quantize take first.
    bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    h = (bh % HKV).to(tl.int64)
    if chunk == tl.num_programs(1) - 1:
        count = tl.minimum(N, SAMPLES)
        k_sum = tl.zeros([HEAD_DIM], tl.float32)
        for r in range(0, SAMPLES, SAMPLE_TILE):
            i = r + tl.arange(0, SAMPLE_TILE)
            rows = tl.where(i < count, (i.to(tl.int64) * N // count).to(tl.int32), N)  # N: masked off
            k_sum += tl.sum(_load_rows(K, b, h, rows, N, stride_kb, stride_kh, stride_kn, stride_kd, D_QK, HEAD_DIM),
                            axis=0)
        mean = tl.math.div_rn(k_sum, tl.zeros([HEAD_DIM], tl.float32) + count.to(tl.float32))
        tl.store(KMEAN + bh * HEAD_DIM + tl.arange(0, HEAD_DIM), mean)
    else:
        v_max = tl.zeros([TILE, HEAD_DIM_V], tl.float32)
        start = chunk * CHUNK
        for n0 in range(start, tl.minimum(start + CHUNK, N), TILE):
            rows = n0 + tl.arange(0, TILE)
            v = _load_rows(V, b, h, rows, N, stride_vb, stride_vh, stride_vn, stride_vd, D_V, HEAD_DIM_V)
            v_max = tl.maximum(v_max, tl.where(tl.abs(v) < float("inf"), tl.abs(v), 0.0))  # formats.finite_amax
        tl.store(VMAX + bh * (tl.num_programs(1) - 1) + chunk, tl.max(tl.max(v_max, 1), 0))


@triton.jit
def _amax_scale(amax, fmax):
    """formats._amax_scale: an all-zero block gets scale 1, NaN/Inf stay in the scale."""
    return tl.where(amax == 0, 1.0, tl.math.div_rn(amax, fmax))


@triton.jit
def _per_scale(x, scale):
    """formats._per_scale: one IEEE division per scale, a multiplication per element."""
    return x * tl.math.div_rn(1.0, scale)


@triton.jit
def _round_int8(x, EMULATE: tl.constexpr):
    if EMULATE:  # the interpreter has no libdevice: the magic-number add rounds to nearest even
        r = tl.where(tl.abs(x) < 4194304.0, (x + 12582912.0) - 12582912.0, x)
    else:
        r = libdevice.rint(x)
    return tl.clamp(r, -127.0, 127.0).to(tl.int8)


@triton.jit
def _q_rows(pid, Q, Q8, QS, sm_scale, H, NQ, stride_qb, stride_qh, stride_qn, stride_qd,
            D: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, EMULATE: tl.constexpr):
    bh, tile, b, h = _tile_of(pid, NQ, H, ROWS)
    rows = tile * ROWS + tl.arange(0, ROWS)
    x = _load_rows(Q, b, h, rows, NQ, stride_qb, stride_qh, stride_qn, stride_qd, D, HEAD_DIM) * sm_scale
    scale = _amax_scale(tl.reduce(tl.abs(x), 1, max_propagate_nan), 127.0)
    _store_rows(Q8, bh, rows, NQ, _round_int8(_per_scale(x, scale[:, None]), EMULATE), D, HEAD_DIM)
    tl.store(QS + bh.to(tl.int64) * NQ + rows, scale, mask=rows < NQ)


@triton.jit
def _k_block(pid, K, K8, KS, KMEAN, HKV, NK, stride_kb, stride_kh, stride_kn, stride_kd,
             D: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
             EMULATE: tl.constexpr):
    # The block is read twice in TILE-row pieces (the second time from cache): its scale
    # needs the whole block, which in registers would take all 255 a thread has.
    bh, block, b, h = _tile_of(pid, NK, HKV, ROWS)
    mean = tl.load(KMEAN + bh * HEAD_DIM + tl.arange(0, HEAD_DIM))
    amax = tl.zeros([TILE, HEAD_DIM], tl.float32)
    for r in range(0, ROWS, TILE):
        rows = block * ROWS + r + tl.arange(0, TILE)
        k = _load_rows(K, b, h, rows, NK, stride_kb, stride_kh, stride_kn, stride_kd, D, HEAD_DIM)
        k = tl.where(rows[:, None] < NK, k - mean[None, :], 0.0)  # zero padded after smoothing
        amax = tl.maximum(amax, tl.abs(k), propagate_nan=tl.PropagateNan.ALL)
    scale = _amax_scale(tl.reduce(amax, None, max_propagate_nan), 127.0)
    for r in range(0, ROWS, TILE):
        rows = block * ROWS + r + tl.arange(0, TILE)
        k = _load_rows(K, b, h, rows, NK, stride_kb, stride_kh, stride_kn, stride_kd, D, HEAD_DIM) - mean[None, :]
        _store_rows(K8, bh, rows, NK, _round_int8(_per_scale(k, scale), EMULATE), D, HEAD_DIM)
    blocks = tl.cdiv(NK, ROWS)
    tl.store(KS + bh * (blocks + 1) + block, scale)
    if block == blocks - 1:  # formats.scale_blocks: the spare block after the last has scale 1
        tl.store(KS + bh * (blocks + 1) + blocks, 1.0)


@triton.jit
def _v_rows(pid, V, VT, VS, VMAX, HKV, KV_HEADS, NK, N_CHUNKS, stride_vb, stride_vh, stride_vn, stride_vd,
            D: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, EMULATE: tl.constexpr):
    # The last tiles of every head first: the tokens _stats read last.
    bh = pid % KV_HEADS
    tile = tl.cdiv(NK, ROWS) - 1 - pid // KV_HEADS
    b, h = (bh // HKV).to(tl.int64), (bh % HKV).to(tl.int64)
    rows = tile * ROWS + tl.arange(0, ROWS)
    amax = tl.zeros([1], tl.float32)
    for c in range(N_CHUNKS):
        amax = tl.maximum(amax, tl.load(VMAX + bh * N_CHUNKS + c + tl.zeros([1], tl.int32)),
                          propagate_nan=tl.PropagateNan.ALL)
    scale = _amax_scale(amax, 448.0)
    v = _load_rows(V, b, h, rows, NK, stride_vb, stride_vh, stride_vn, stride_vd, D, HEAD_DIM)
    v8 = tl.clamp(_per_scale(v, scale[:, None]), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    v8 = tl.where(tl.abs(v) < float("inf"), v8, float("nan"))  # Inf and NaN become V's NaN code
    # K-major store: the tile goes out transposed, tokens contiguous.
    v_index = bh.to(tl.int64) * D * NK + tl.arange(0, HEAD_DIM)[None, :].to(tl.int64) * NK + rows[:, None]
    if EMULATE:  # the interpreter's float8 casts neither round to nearest even nor keep NaN
        bits = e4m3_round(v8).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        v8 = tl.where(v8 == v8, bits, 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        v8 = v8.to(tl.float8e4nv)
    tl.store(VT + v_index, v8, mask=_in_bounds(rows, NK, D, HEAD_DIM))
    tl.store(VS + bh + tl.zeros([1], tl.int32), scale, mask=(tl.zeros([1], tl.int32) + tile) == 0)


@triton.jit
def _quantize(Q, K, V, Q8, QS, K8, KS, VT, VS, KMEAN, VMAX,
              sm_scale, H, HKV, KV_HEADS, NQ, NK, N_V_PROGRAMS, N_K_PROGRAMS, N_CHUNKS,
              stride_qb, stride_qh, stride_qn, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              D_QK: tl.constexpr, D_V: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              Q_ROWS: tl.constexpr, K_BLOCK: tl.constexpr, K_TILE: tl.constexpr, V_ROWS: tl.constexpr,
              EMULATE: tl.constexpr):
    # Three kinds of programs, each on one small tile (few registers, many programs in flight).
    pid = tl.program_id(0)
    if pid < N_V_PROGRAMS:
        _v_rows(pid, V, VT, VS, VMAX, HKV, KV_HEADS, NK, N_CHUNKS,
                stride_vb, stride_vh, stride_vn, stride_vd, D_V, HEAD_DIM_V, V_ROWS, EMULATE)
    elif pid < N_V_PROGRAMS + N_K_PROGRAMS:
        _k_block(pid - N_V_PROGRAMS, K, K8, KS, KMEAN, HKV, NK, stride_kb, stride_kh, stride_kn, stride_kd,
                 D_QK, HEAD_DIM, K_BLOCK, K_TILE, EMULATE)
    else:
        _q_rows(pid - N_V_PROGRAMS - N_K_PROGRAMS, Q, Q8, QS, sm_scale, H, NQ, stride_qb, stride_qh, stride_qn,
                stride_qd, D_QK, HEAD_DIM, Q_ROWS, EMULATE)


def quantize_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float):
    """``formats.quantize_inputs(q, k, v, sm_scale, "fp8")``: ``(q8, k8, v_t, q_scale,
    k_scale, v_scale)`` from ``[B, H, N, D]`` views with any strides; outputs are contiguous."""
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    dev = q.device
    q8 = torch.empty(b, h, nq, d, dtype=torch.int8, device=dev)
    q_scale = torch.empty(b, h, nq, dtype=torch.float32, device=dev)
    k8 = torch.empty(b, hkv, nk, d, dtype=torch.int8, device=dev)
    k_scale = torch.empty(b, hkv, F.scale_blocks(nk), dtype=torch.float32, device=dev)
    v_t = torch.empty(b, hkv, dv, nk, dtype=F.E4M3, device=dev)
    v_scale = torch.empty(b, hkv, dtype=torch.float32, device=dev)
    if q8.numel() == 0 or k8.numel() == 0:
        return q8, k8, v_t, q_scale, k_scale, v_scale

    # Enough stats programs to fill the GPU a few times over; chunks a multiple of the tile.
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    tiles = triton.cdiv(nk, _STATS_TILE)
    chunks = max(1, min(tiles, triton.cdiv(4 * sms, b * hkv)))
    chunk = triton.cdiv(tiles, chunks) * _STATS_TILE
    chunks = triton.cdiv(nk, chunk)
    dims = dict(D_QK=d, D_V=dv, HEAD_DIM=F.kernel_head_dim(d), HEAD_DIM_V=F.kernel_head_dim(dv))
    k_mean = torch.empty(b * hkv, dims["HEAD_DIM"], dtype=torch.float32, device=dev)
    v_max = torch.empty(b * hkv, chunks, dtype=torch.float32, device=dev)
    _stats[(b * hkv, chunks + 1)](k, v, k_mean, v_max, nk, chunk, hkv, *k.stride(), *v.stride(), **dims,
                                  TILE=_STATS_TILE, SAMPLES=F.K_MEAN_SAMPLES, SAMPLE_TILE=_K_TILE,
                                  num_warps=_STATS_WARPS, num_stages=_STATS_STAGES)
    v_programs = b * hkv * triton.cdiv(nk, _V_ROWS)
    k_programs = b * hkv * triton.cdiv(nk, F.SCALE_BLOCK)
    grid = (v_programs + k_programs + b * h * triton.cdiv(nq, _Q_ROWS),)
    _quantize[grid](q, k, v, q8, q_scale, k8, k_scale, v_t, v_scale, k_mean, v_max,
                    float(sm_scale), h, hkv, b * hkv, nq, nk, v_programs, k_programs, chunks,
                    *q.stride(), *k.stride(), *v.stride(),
                    **dims, Q_ROWS=_Q_ROWS, K_BLOCK=F.SCALE_BLOCK, K_TILE=_K_TILE, V_ROWS=_V_ROWS,
                    EMULATE=os.environ.get("TRITON_INTERPRET", "0") == "1",
                    num_warps=_WARPS, num_stages=1)
    return q8, k8, v_t, q_scale, k_scale, v_scale
