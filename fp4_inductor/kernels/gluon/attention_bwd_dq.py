"""Warp-specialised Hopper (sm_90) dQ kernel in Gluon, P mode ``direct``.

The dQ half of ``kernels/triton/attention_bwd.py`` in the forward Gluon kernel's structure:
one program per 128 query rows of one head, a producer warp streaming K and V (rows in the
P-operand order, as the forward's K) and Keᵀ tiles through a two-stage ring, two consumer
warpgroups of 64 rows that issue to the tensor cores without taking turns: the forward's
turn handover costs a warpgroup barrier a step, and dropping it made the backward 1-3 %
faster on the H200.  Per key tile j and warpgroup:

  S = Q·Kᵀ (INT8, exact),  dP = dO·Vᵀ (E5M2 × E4M3),
  P = Direct-P codes against the forward's row reference,
  dS = P ∘ (dP·do_scale·v_scale − delta) → E4M3 with one amax scale per query row of the
  tile (``formats.DS_BLOCK_DQ``: a reduction within the row's four threads),
  dQ += (dS·Ke)·(ds_scale_row·ke_scale)  — issued once dS is ready, one product in flight.

It computes the numbers of the Triton dQ kernel (the same tiles and formulas).  Issuing
tile j-1's product under tile j's S and dP instead (the forward's P·V order) kept dQ, that
product's part (float32 [64, D] each), S (int32) and dP (float32 [64, 128] each) live and
spilled: a 320-byte frame and ~2 KB of spill stores at D = 128, where on the H200 a third
of its stalls waited on local memory, and a 32-byte frame at D = 64.  In this order neither
head dim spills (docs/perf-notes/2026-11.md, "Where the backward's time goes now").

Scope (``supports``): P mode direct, no bias or a key-row bias, D in {64, 128}, Nk a multiple of 16; Q, K,
V and the row vectors contiguous, dO with any strides TMA accepts, dQ (stored through
pointers) with non-negative strides whose offsets within a batch fit 32 bits.

A key-row bias (key padding, ``KEY_BIAS``) is taken as the forward Gluon kernel takes
it: ``key_bias.tile_ranges`` narrows each program's key tiles to those that keep a key
(dS is 0 on the others), the zero run is unmasked and its edge tiles add the bias
(``attention_fwd._scores``).  Its gradients equal the Triton kernel's bit for bit on the
H200, and the padded training step's kernels run 1.6-3.8x faster than on the Triton
kernels (docs/perf-notes/2026-12.md, "The Gluon backward takes key padding: switched on").
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import formats as F
from ..triton.key_bias import key_row_bias, launch_rows
from .attention_fwd import (_LAUNCH, _REGS, _compile_sm90, _e4m3, _key_bias_tiles, _layout, _p_operand,
                            _probability, _program_tiles, _ring_barriers, _scores, _store_rows, _tensor_desc,
                            _wgmma_layout)

BLOCK_N = F.KEY_TILE
BM_WG = 64  # query rows per consumer warpgroup
assert F.DS_BLOCK_DQ == (1, BLOCK_N)  # one dS scale per query row and key tile
NUM_STAGES = 2
DS_SCALE_MIN = gl.constexpr(F.DS_SCALE_MIN)
# Key-row biases (module docstring); off sends them to the Triton kernel (A/B runs).
KEY_BIAS = True


@gluon.jit
def _ds_operand(p, dp, delta, dov_scale):
    """dS = P ∘ (dP·scale − delta) as E4M3 codes with one amax scale per row of the tile
    (rows are queries here, keys in a transposed tile; formats.ds_scale: floored, so its
    inverse is finite and a row's exact zeros stay zeros), rounded and saturated by the
    cvt instruction as the forward's exp mode; a NaN element stays NaN (the amax skips
    it), as in the Triton kernel; ``delta`` broadcast to the tile ([rows, 1], or [1, cols]
    for a transposed tile).  The scales are returned per row."""
    ds = p * (dp * dov_scale - delta)
    amax = gl.max(gl.abs(ds), 1)
    ds_scale = gl.div_rn(amax, 448.0)
    ds_scale = gl.where(ds_scale < DS_SCALE_MIN, DS_SCALE_MIN, ds_scale)
    ds8 = _e4m3(ds * gl.div_rn(1.0, ds_scale)[:, None]).to(gl.float8e4nv, bitcast=True)
    return ds8, ds_scale


@gluon.jit
def _rows(v, acc):
    """A per-row vector of a score tile as a row factor of the accumulator ``acc`` (the
    same rows in the same threads: no data moves)."""
    return gl.convert_layout(v, gl.SliceLayout(1, acc.type.layout), assert_trivial=True)[:, None]


@gluon.jit
def _issue_s_dp(s_a, s_b, dp_a, dp_b, M: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
    """Issue S = s_a·s_bᵀ (INT8 into int32) and dP = dp_a·dp_bᵀ (8-bit floats into
    float32), [M, N] in ``layout``, asynchronously; the operands are [rows, D] tiles in
    shared memory."""
    s = warpgroup_mma(s_a, s_b.permute((1, 0)), gl.zeros([M, N], gl.int32, layout), use_acc=False, is_async=True)
    dp = warpgroup_mma(dp_a, dp_b.permute((1, 0)), gl.zeros([M, N], gl.float32, layout), use_acc=False,
                       is_async=True)
    return s, dp


@gluon.jit
def _step(i, j, dq, q, do, rows, row_t, r, delta, dov_scale, ks_ptr, kes_ptr, bias_row, NK, masked, smem, bars,
          HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
          CAUSAL: gl.constexpr, KEY_BIAS: gl.constexpr):
    """Iteration i (the ring's count), key tile j: S_j and dP_j on the tensor cores, dS_j,
    then its product dS_j·Ke_j, which joins dQ with the tile's scales (two-level
    accumulation).  ``masked``: the tile may hold keys past NK, (causal) after a row or
    (KEY_BIAS) a nonzero bias, else it is known whole and unbiased; at D = 64
    a runtime value (a branch between two compiled copies of the scores, joined before P,
    so the rest of the step is compiled once), at D = 128 a literal, so that each kind of
    tile gets its own copy of the step (``_consumer``)."""
    q_smem, do_smem, k_bufs, v_bufs, ke_bufs = smem
    in_bar, kv_ready, kv_empty, ke_ready, ke_empty = bars
    s_layout: gl.constexpr = _wgmma_layout(BN, gl.num_warps())
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=4)
    stage = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(kv_ready.index(stage), phase)
    s, dp = _issue_s_dp(q, k_bufs.index(stage).reshape([BN, HEAD_DIM]), do, v_bufs.index(stage).reshape([BN, HEAD_DIM]),
                        BM, BN, s_layout)
    s, dp = warpgroup_mma_wait(0, deps=(s, dp))
    mbarrier.arrive(kv_empty.index(stage))
    if masked:
        x, t = _scores(s, row_t, ks_ptr, bias_row, j, rows, NK, 0, 0, BN, CAUSAL, False, True, False, KEY_BIAS)
    else:
        x, t = _scores(s, row_t, ks_ptr, bias_row, j, rows, NK, 0, 0, BN, CAUSAL, False, False, False, KEY_BIAS)
    p = _probability(x, t[:, None], r[:, None], False, KEY_BIAS).to(gl.float32)
    ds8, ds_scale = _ds_operand(p, dp, delta[:, None], dov_scale)
    mbarrier.wait(ke_ready.index(stage), phase)
    part = warpgroup_mma(_p_operand(ds8, a_layout, BM, BN), ke_bufs.index(stage).reshape([HEAD_DIM, BN])
                         .permute((1, 0)), gl.zeros_like(dq), use_acc=False, is_async=True)
    part = warpgroup_mma_wait(0, deps=(part,))
    mbarrier.arrive(ke_empty.index(stage))
    return dq + part * _rows(ds_scale * gl.load(kes_ptr + j), dq)


@gluon.jit
def _consumer(qs_ptr, ks_ptr, kes_ptr, delta_ptr, ref_ptr, dq_ptr, bias_row, smem, bars, dq_strides,
              dov_scale, bh, H, start_m, NQ, NK, lo, hi, n_full,
              WG: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, KEY_BIAS: gl.constexpr):
    q_smem, do_smem, k_bufs, v_bufs, ke_bufs = smem
    in_bar, kv_ready, kv_empty, ke_ready, ke_empty = bars
    nw: gl.constexpr = gl.num_warps()
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM, nw)
    row_s: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(BN, nw))

    rows = start_m + WG * BM + gl.arange(0, BM, row_s)
    row_ok = rows < NQ
    row = bh * NQ + rows  # the row vectors are contiguous [B, H, Nq]
    row_t = gl.load(qs_ptr + row, mask=row_ok, other=0.0) * 1.4426950408889634  # LOG2E, as the reference
    r = gl.load(ref_ptr + row, mask=row_ok, other=0.0)
    delta = gl.load(delta_ptr + row, mask=row_ok, other=0.0)
    q = q_smem.index(WG).reshape([BM, HEAD_DIM])
    do = do_smem.index(WG).reshape([BM, HEAD_DIM])
    mbarrier.wait(in_bar, 0)

    # One product in flight, none while S and dP are: dQ, S and dP (3 x 64 registers a
    # thread at D = 128), where issuing tile j-1's product under S_j and dP_j kept dQ, its
    # part, S and dP live and spilled; the other warpgroup's scores keep the tensor cores
    # busy while this one waits on its product.
    # Key tiles lo .. hi - 1 (``_dq_ws``): lo + 1 .. n_full - 1 need no mask.
    dq = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)
    if HEAD_DIM == 64:  # one compiled step with a runtime mask branch: 5 % faster than three copies at 16k
        for j in range(lo, hi):
            dq = _step(j - lo, j, dq, q, do, rows, row_t, r, delta, dov_scale, ks_ptr, kes_ptr, bias_row, NK,
                       (j == lo) | (j >= n_full), smem, bars, HEAD_DIM, BM, BN, STAGES, CAUSAL, KEY_BIAS)
    else:  # at D = 128 that branch inside the loop costs 5 %: the whole tiles get their own copy
        dq = _step(0, lo, dq, q, do, rows, row_t, r, delta, dov_scale, ks_ptr, kes_ptr, bias_row, NK, True, smem,
                   bars, HEAD_DIM, BM, BN, STAGES, CAUSAL, KEY_BIAS)
        for j in range(lo + 1, n_full):
            dq = _step(j - lo, j, dq, q, do, rows, row_t, r, delta, dov_scale, ks_ptr, kes_ptr, bias_row, NK, False,
                       smem, bars, HEAD_DIM, BM, BN, STAGES, CAUSAL, KEY_BIAS)
        for j in range(n_full, hi):
            dq = _step(j - lo, j, dq, q, do, rows, row_t, r, delta, dov_scale, ks_ptr, kes_ptr, bias_row, NK, True,
                       smem, bars, HEAD_DIM, BM, BN, STAGES, CAUSAL, KEY_BIAS)

    _store_rows(dq_ptr, dq, start_m + WG * BM, 0, bh // H, bh % H, NQ, dq_strides)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, ke_desc, smem, bars, bh, H, start_m, kv_head, lo, n_tiles, NK,
              BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    q_smem, do_smem, k_bufs, v_bufs, ke_bufs = smem
    in_bar, kv_ready, kv_empty, ke_ready, ke_empty = bars
    mbarrier.expect(in_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [bh // H, bh % H, start_m + w * BM, 0], in_bar, q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [bh // H, bh % H, start_m + w * BM, 0], in_bar, do_smem.index(w))
    for i in range(n_tiles):
        s = i % STAGES
        phase = (i // STAGES) & 1
        j = lo + i
        mbarrier.wait(kv_empty.index(s), phase ^ 1)  # a fresh barrier counts as released
        mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        chunk = kv_head * (NK // 16) + j * (BN // 16)  # K and V rows in the P-operand order
        tma.async_copy_global_to_shared(k_desc, [chunk, 0, 0, 0, 0], kv_ready.index(s), k_bufs.index(s))
        tma.async_copy_global_to_shared(v_desc, [chunk, 0, 0, 0, 0], kv_ready.index(s), v_bufs.index(s))
        mbarrier.wait(ke_empty.index(s), phase ^ 1)
        mbarrier.expect(ke_ready.index(s), ke_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(ke_desc, [kv_head, 0, j * BN], ke_ready.index(s), ke_bufs.index(s))


@gluon.jit
def _dq_ws(q_desc, do_desc, k_desc, v_desc, ke_desc, qs_ptr, ks_ptr, kes_ptr, dos_ptr, vs_ptr, delta_ptr, ref_ptr,
           dq_ptr, bias_ptr, ranges_ptr, stride_dqb, stride_dqh, stride_dqm, stride_dqd, stride_ksb, bias_row_b,
           bias_row_h, H, GROUP, NQ, NK,
           HEAD_DIM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
           KEY_BIAS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[2]
    # SDPA's causal structure (top-left) or none: the tiles start at 0; tile 0 is always
    # treated as masked, so the unmasked run starts at 1.
    start_m, bh, kv_head, tiles = _program_tiles(NK, GROUP, 0, 0, BM, BN, CAUSAL, False)
    lo, n_tiles, n_full = tiles[0], tiles[1], gl.maximum(tiles[3], 1)
    bias_row = bias_ptr
    if KEY_BIAS:  # the tiles that keep a key; unmasked: the zero run's, from lo + 1 (the forward's rule)
        row = (bh // H) * bias_row_b + (bh % H) * bias_row_h
        lo, n_tiles, full_lo, full_hi = _key_bias_tiles(tiles, ranges_ptr + row * 4)
        bias_row = bias_ptr + row.to(gl.int64) * NK
        full_hi = gl.where(full_lo <= lo + 1, full_hi, lo + 1)
        n_full = gl.minimum(gl.maximum(full_hi, lo + 1), lo + n_tiles)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    ke_bufs = gl.allocate_shared_memory(ke_desc.dtype, [STAGES] + ke_desc.block_type.shape, ke_desc.layout)
    bars = _ring_barriers(STAGES)  # (in_bar, kv_ready, kv_empty, ke_ready, ke_empty)

    dov_scale = gl.load(dos_ptr + bh) * gl.load(vs_ptr + kv_head)
    smem = (q_smem, do_smem, k_bufs, v_bufs, ke_bufs)
    dq_strides = (stride_dqb, stride_dqh, stride_dqm, stride_dqd)
    ks_head = ks_ptr + kv_head * stride_ksb
    kes_head = kes_ptr + kv_head * stride_ksb
    hi = lo + n_tiles
    gl.warp_specialize([
        (_consumer, (qs_ptr, ks_head, kes_head, delta_ptr, ref_ptr, dq_ptr, bias_row, smem, bars, dq_strides,
                     dov_scale, bh, H, start_m, NQ, NK, lo, hi, n_full, 0, HEAD_DIM, BM, BN, STAGES, CAUSAL,
                     KEY_BIAS)),
        (_consumer, (qs_ptr, ks_head, kes_head, delta_ptr, ref_ptr, dq_ptr, bias_row, smem, bars, dq_strides,
                     dov_scale, bh, H, start_m, NQ, NK, lo, hi, n_full, 1, HEAD_DIM, BM, BN, STAGES, CAUSAL,
                     KEY_BIAS)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, ke_desc, smem, bars, bh, H, start_m, kv_head, lo, n_tiles, NK,
                     BM, BN, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _permuted_rows(t, tile, dtype):
    """A 5-D TMA descriptor over the rows of contiguous [B, H, N, D] ``t`` in tiles of
    ``tile`` rows, each in the P-operand order (``attention_fwd._key_order``)."""
    d = t.shape[-1]
    block = [tile // 16, 2, 4, 2, d]
    return TensorDescriptor(t, [t.numel() // (16 * d), 2, 4, 2, d], [16 * d, 2 * d, 4 * d, d, 1], block,
                            _layout(block, dtype))


_CONSTEXPRS = dict(BN=BLOCK_N, STAGES=NUM_STAGES, **_REGS)


def _token_major_desc(t, tokens, dtype):
    """[B, H, D, N] token-major view (rows 16-byte aligned: ``attention_bwd_prep``'s
    ``_token_major_empty``) as [B*H, D, N] tiles of ``tokens`` tokens."""
    block = [1, t.shape[2], tokens]
    return TensorDescriptor(t, [t.shape[0] * t.shape[1], t.shape[2], t.shape[3]], [t.stride(1), t.stride(2), 1],
                            block, _layout(block, dtype))


def _tma_ready(t) -> bool:
    """A TMA descriptor can address ``t`` in place: unit last stride, 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def supports(do, delta, q, k, v, q_scale, ke_t, k_scale, ke_scale, row_ref, bias, p_mode, dq) -> bool:
    """Whether this kernel can compute the call (module docstring).  Arguments as
    ``dq_backward`` (``attention_bwd_prep.BackwardOperands``' fields)."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    rows = (h * nq, nq, 1)
    return (p_mode == "direct" and (bias is None or KEY_BIAS and key_row_bias(bias, b, h, nq, nk))
            and d in (64, 128) and nk % 16 == 0 and nq > 0 and nk > 0
            and h % hkv == 0 and b * h < 65536  # the grid's second dimension
            and q.dtype == k.dtype == torch.int8 and do.dtype == F.E5M2 and v.dtype == ke_t.dtype == F.E4M3
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v))  # 5-D/flat TMA views
            and _tma_ready(do) and _tma_ready(ke_t) and ke_t.stride(0) == hkv * ke_t.stride(1)
            and all(t.stride() == rows for t in (delta, q_scale, row_ref))  # indexed bh * Nq + row
            and k_scale.shape == ke_scale.shape and k_scale.is_contiguous() and ke_scale.is_contiguous()
            and all(st >= 0 for st in dq.stride()) and b * h * nq < 2**31
            # dQ offsets within a batch are 32-bit (the batch's is 64)
            and sum((n - 1) * st for n, st in zip(dq.shape[1:], dq.stride()[1:])) < 2**31)


def dq_backward(do, do_scale, delta, q, k, v, q_scale, k_scale, v_scale, ke_t, ke_scale, row_ref, causal, dq,
                key_rows=None):
    """dQ (as ``ke_scale`` scales it: ``ops.attention_bwd``) into ``dq`` [B, H, Nq, D]
    for the calls (strides included) that ``supports`` accepts.  ``v`` is V row-major
    [B, Hkv, Nk, D], ``ke_t`` the token-major E4M3 K [B, Hkv, D, Nk], ``key_rows`` the
    call's ``key_bias.KeyRows`` (a key-row bias) or None; the rest as
    ``reference.attention_backward``, float32 scales and rows."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    bias_rows, ranges, row_b, row_h = launch_rows(key_rows, BLOCK_N, row_ref)
    q_block = [1, 1, BM_WG, d]
    q_desc = TensorDescriptor.from_tensor(q, q_block, _layout(q_block, gl.int8))
    do_desc = TensorDescriptor.from_tensor(do, q_block, _layout(q_block, gl.float8e5))
    k_scale, ke_scale = k_scale.reshape(b * hkv, -1), ke_scale.reshape(b * hkv, -1)
    _dq_ws[(triton.cdiv(nq, 2 * BM_WG), b * h)](
        q_desc, do_desc, _permuted_rows(k, BLOCK_N, gl.int8), _permuted_rows(v, BLOCK_N, gl.float8e4nv),
        _token_major_desc(ke_t, BLOCK_N, gl.float8e4nv),
        q_scale, k_scale, ke_scale, do_scale.reshape(-1), v_scale.reshape(-1), delta, row_ref, dq, bias_rows, ranges,
        *dq.stride(), k_scale.stride(0), row_b, row_h, h, h // hkv, nq, nk,
        HEAD_DIM=d, CAUSAL=bool(causal), KEY_BIAS=key_rows is not None, **_CONSTEXPRS, **_LAUNCH)


def compile_for_sm90(d: int, causal: bool, key_bias: bool = False):
    """Compile without a GPU (Triton's bundled ptxas), for inspection: the compiled kernel."""
    perm = [BLOCK_N // 16, 2, 4, 2, d]
    sig = {"q_desc": _tensor_desc("i8", [1, 1, BM_WG, d], gl.int8),
           "do_desc": _tensor_desc("fp8e5", [1, 1, BM_WG, d], gl.float8e5),
           "k_desc": _tensor_desc("i8", perm, gl.int8), "v_desc": _tensor_desc("fp8e4nv", perm, gl.float8e4nv),
           "ke_desc": _tensor_desc("fp8e4nv", [1, d, BLOCK_N], gl.float8e4nv), "dq_ptr": "*bf16",
           "ranges_ptr": "*i32"}
    for name in ("qs_ptr", "ks_ptr", "kes_ptr", "dos_ptr", "vs_ptr", "delta_ptr", "ref_ptr", "bias_ptr"):
        sig[name] = "*fp32"
    return _compile_sm90(_dq_ws, sig, dict(HEAD_DIM=d, CAUSAL=causal, KEY_BIAS=key_bias, **_CONSTEXPRS))
