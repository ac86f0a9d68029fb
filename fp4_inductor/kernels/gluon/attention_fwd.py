"""Warp-specialised Hopper (sm_90) forward in Gluon, P modes ``direct`` and ``exp``.

The numerics of ``kernels/triton/attention_fwd.py`` (INT8 Q.K^T on the tensor cores with
exact int32 scores, log2 scores s t with t = q_scale log2e k_scale (Direct-P takes the
product unrounded into its FFMA, exp rounds it first), an integer running maximum,
Direct-P E4M3 codes, E4M3 P.V with the two-level accumulation), restructured as
FlashAttention-3 does on Hopper:

- a producer warp streams K [128, D] and V^T [D, 128] tiles through a shared-memory ring
  with TMA and mbarriers;
- two consumer warpgroups of 64 query rows each take turns on the tensor cores (``turn``
  barriers): one issues its Q.K^T and P.V while the other runs its softmax;
- the row sums come from the tensor cores too: P times a [128, 8] block of ones, a
  third, narrow product per tile, instead of a shift and an add per element;
- K rows arrive in the order that makes each thread's accumulator fragment of P its own
  fp8 A-operand fragment (a 5-D TMA box, see ``_key_order``), so P reaches P.V without
  register shuffles;
- a program walks only the key tiles its rows can see (causal: up to the diagonal, and
  from a sliding window's lower edge; with a key-padding bias, from its first to its last
  tile that keeps a key); tiles wholly visible run without masks, and without the bias
  where all its values are zero (``key_bias``).

One deviation from the reference: the row sum of the codes is summed by the tensor
core, whose fp8 accumulation keeps fewer mantissa bits than float32, so the LSE is
within ~2e-4 of the reference's instead of ~2e-6 on Gaussian inputs (measured on the
H200).  The loss is relative to the largest code a tile adds, so rows with one dominant
key per tile (attention sinks) lose more.  P codes, row references and the output
(within the reference's tolerance) are unchanged.

Scope (``supports``): P mode ``direct`` or ``exp`` (the ablation: exp2 on the MUFU and
the convert instruction, in the same kernel structure), no bias or one bias row per
(batch, head) that every query adds (key padding: ``key_bias``), D in {64, 128}, Nk a
multiple of 16 (TMA needs the V^T rows 16-byte aligned and K in whole 16-key chunks),
contiguous operands; causal with any diagonal offset and sliding window
(``formats.visible``; rows with no visible key get O = 0, LSE -inf) or not; GQA/MQA.
Which calls it gets is decided per call by ``kernels._forward`` (``_gluon_wins``: keys,
queries, programs, windows); the rest run the Triton kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import formats as F
from ..triton.key_bias import KeyRows, key_row_bias, launch_rows

BLOCK_N = F.KEY_TILE
BM_WG = 64  # query rows per consumer warpgroup (two per program)
ONES_N = gl.constexpr(8)  # the narrowest wgmma: P times [BN, 8] ones gives each row's sum 8 times
E4M3_ONE = gl.constexpr(0x38)
NUM_STAGES = 2  # K/V ring depth: 3 measured no faster on the H200
# (docs/perf-notes/2026-11.md, "Warp-specialised forward in Gluon", g2)
# Registers of the warp-specialised kernels here (forward, dQ, dK/dV): setmaxnreg values of
# the worker partitions (a second consumer warpgroup where there is one, the producer), and
# the launch's cap per thread (12 warps share the register file).
_REGS = dict(CONSUMER_REGS=240, PRODUCER_REGS=24)
_LAUNCH = dict(num_warps=4, maxnreg=168)


@gluon.constexpr_function
def _wgmma_layout(n, num_warps):
    """Register layout of a Hopper wgmma result [rows, n] (8-bit operands: K step 32)
    over a warpgroup's ``num_warps`` warps."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 32])


@gluon.jit
def _mul_rn(a, b):
    """a * b rounded on its own (never contracted into a later FMA), as the reference."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _fma_sat(x, a, b):
    """fma(x, a, b) clamped to [0, 1] in one instruction (FFMA.SAT)."""
    return gl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f", [x, a, b], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _max_nan(a, b):
    """Combine function of a NaN-propagating row maximum: a NaN score makes its row NaN,
    as in the reference (a plain max would drop it, and FFMA.SAT would turn it into 0)."""
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _e4m3(v):
    """E4M3 codes (RNE, saturating) of float32 ``v``, one cvt per pair (the first element
    goes to the low byte)."""
    return gl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [v], dtype=gl.uint8,
                                     is_pure=True, pack=2)


@gluon.jit
def _probability(x, t, m, EXP: gl.constexpr, SCALED: gl.constexpr):
    """The E4M3 P operand of one tile, as the Triton kernel's _probability, from
    ``_scores``'s x and t, against the row references ``m``; t and m are [rows, 1]; a row
    whose reference is still -inf gets P = 0 (built against 0: exp's x - m would be NaN).
    Direct-P: ``_direct_p`` of the integer scores with the bias of m, or (SCALED) of the
    log2 scores with t = 1; exp: exp2(x - m + 8) of the log2 scores, converted by the
    cvt instruction."""
    m = gl.where(m == float("-inf"), 0.0, m)  # a row with no visible key yet: P = 0, not NaN
    if EXP:
        return _e4m3(gl.exp2(x - m + 8.0)).to(gl.float8e4nv, bitcast=True)
    if SCALED:
        return _direct_p(x, gl.full_like(t, 0.03125), _direct_p_bias(m))
    return _direct_p(x, t * 0.03125, _direct_p_bias(m))


@gluon.jit
def _direct_p_bias(m):
    """Direct-P's bias of a row reference m, (120 - 8 m) / 256 (exact but for one
    rounding).  A launcher can evaluate it on torch tensors (``_direct_p_bias.fn``): the
    same operations, the same float32 result."""
    return (120.0 - 8.0 * m) * 0.00390625


@gluon.jit
def _direct_p(s, t32, bias):
    """Direct-P's E4M3 codes from the integer scores s (float32, -inf where masked), the
    log2 scale over 32, t32 = t / 32, and a row's ``_direct_p_bias``:
    z = sat(s * t32 + bias) in one FFMA, the product entering it unrounded
    (reference.log2_scores), and z + 2**15 leaves rne(256 z) in the low byte."""
    z = _fma_sat(s, t32, bias)
    return (z + 32768.0).to(gl.int32, bitcast=True).to(gl.uint8).to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _key_order(BN: gl.constexpr, layout: gl.constexpr):
    """Key held by each S column.  K rows arrive so that every thread's accumulator
    fragment of P is its fp8 A-operand fragment (the Triton kernel's _key_permutation):
    column 16c + 8jl + 2q + b holds key 16c + 4q + 2jl + b.  The TMA box
    [16-key chunk, jl, q, b, D] with key strides (16, 2, 4, 1) lays K out that way."""
    c = gl.arange(0, BN, layout)
    return (c // 16) * 16 + ((c // 2) % 4) * 4 + ((c // 8) % 2) * 2 + c % 2


@gluon.jit
def _p_operand(p, p_layout: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """P as the A operand of P.V, columns in key order: a relabelling of registers (the
    compiler asserts that no data moves)."""
    p = p.reshape([BM, BN // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([BM, BN])
    return gl.convert_layout(p, p_layout, assert_trivial=True)


@gluon.jit
def _scores(s, row_t, ks_ptr, bias_row, j, rows, NK, DIAGONAL, WINDOW, BN: gl.constexpr, CAUSAL: gl.constexpr,
            WINDOWED: gl.constexpr, MASKED: gl.constexpr, EXP: gl.constexpr, KEY_BIAS: gl.constexpr):
    """Tile j's scores from its int32 products and the rows' log2 scale t: x, the log2
    scores (EXP or KEY_BIAS, rounded on their own as the reference's), or the integer
    scores as float32 (Direct-P folds t into its FFMA); KEY_BIAS and MASKED: the log2
    scores plus the key biases of ``bias_row`` in one FMA (the reference's), the tiles
    left unmasked having only zero biases (``key_bias``); MASKED: keys past NK and
    (causal) keys the structure hides (``formats.visible``: after row + DIAGONAL, or
    WINDOWED, at or before row + DIAGONAL - WINDOW) at -inf.  Returns (x, t)."""
    if WINDOWED:  # a windowed program's second tile may lie past the keys (``_consumer``)
        t = row_t * gl.load(ks_ptr + gl.minimum(j, (NK - 1) // BN))
    else:
        t = row_t * gl.load(ks_ptr + j)
    x = s.to(gl.float32)
    if MASKED:
        keys = j * BN + _key_order(BN, gl.SliceLayout(0, s.type.layout))
    if KEY_BIAS and MASKED:
        # One bias a thread, then to the score columns' layout (through shared memory):
        # loaded in that layout, the 32 addresses a thread would stay live across loops.
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        flat_keys = j * BN + _key_order(BN, flat)
        bias = gl.load(bias_row + flat_keys, mask=flat_keys < NK, other=0.0)
        x = gl.fma(x, t[:, None], gl.convert_layout(bias, gl.SliceLayout(0, s.type.layout))[None, :])
    elif EXP or KEY_BIAS:
        x = _mul_rn(x, t[:, None])
    if MASKED:
        ok = (keys < NK)[None, :]
        if CAUSAL:
            last = rows[:, None] + DIAGONAL
            ok = ok & (keys[None, :] <= last)
            if WINDOWED:
                ok = ok & (keys[None, :] > last - WINDOW)
        x = gl.where(ok, x, float("-inf"))
    return x, t


@gluon.jit
def _row_max(x, t, SCALED: gl.constexpr):
    """The rows' largest log2 score from ``_scores``: for integer scores (not SCALED) the
    rounded product of the largest one (rounding is monotonic and t > 0), rows all -inf
    staying -inf."""
    x_max = gl.reduce(x, 1, _max_nan)
    if not SCALED:
        x_max = gl.where(x_max == float("-inf"), x_max, _mul_rn(x_max, t))
    return x_max


@gluon.jit
def _products(p, v_buf, ones, part, l_part, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """Issue P.V and P.1 (the row sums) of one tile, asynchronously."""
    pa = _p_operand(p, gl.DotOperandLayout(operand_index=0, parent=part.type.layout, k_width=4), BM, BN)
    part = warpgroup_mma(pa, v_buf.reshape([HEAD_DIM, BN]).permute((1, 0)), part, use_acc=False, is_async=True)
    pl = gl.convert_layout(pa, gl.DotOperandLayout(operand_index=0, parent=l_part.type.layout, k_width=4),
                           assert_trivial=True)
    l_part = warpgroup_mma(pl, ones.permute((1, 0)), l_part, use_acc=False, is_async=True)
    return part, l_part


@gluon.jit
def _step(i, j, state, q, s_zero, row_t, rows, ks_ptr, bias_row, NK, DIAGONAL, WINDOW, smem, bars,
          WG: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
          STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, EXP: gl.constexpr,
          MASKED: gl.constexpr, KEY_BIAS: gl.constexpr):
    """Iteration i, key tile j: S_j on the tensor cores while they run P_{j-1}.V_{j-1}; the
    softmax of S_j; then tile j-1's products join the float32 sums (two-level accumulation),
    which move from m_{j-2} to m_{j-1}: acc alpha_{j-1} + P_{j-1} V_{j-1}, one FFMA each.
    The ring and the turns count iterations (a program's first tile need not be tile 0)."""
    acc, part, l_acc, l_part, m_i, p, alpha = state
    q_smem, k_bufs, v_bufs, ones = smem
    q_bar, k_ready, k_empty, v_ready, v_empty, turn = bars
    stage = i % STAGES
    prev = (i - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (i // STAGES) & 1)
    mbarrier.wait(turn.index(WG), i & 1)
    s = warpgroup_mma(q, k_bufs.index(stage).reshape([BN, HEAD_DIM]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
    part, l_part = _products(p, v_bufs.index(prev), ones, part, l_part, HEAD_DIM, BM, BN)
    mbarrier.arrive(turn.index(1 - WG))
    # A key bias's edge tiles take tile j-1's products before their softmax: its
    # accumulators, freed, make room for the biases (one or two tiles a row: the stall
    # is cheap; carried through the softmax, they spilled at D = 128).
    EARLY: gl.constexpr = KEY_BIAS and MASKED
    if EARLY:
        s, part, l_part = warpgroup_mma_wait(0, deps=(s, part, l_part))
        mbarrier.arrive(v_empty.index(prev))
        acc, l_acc = _accumulate(acc, part, l_acc, l_part, alpha)
    else:
        s = warpgroup_mma_wait(2, deps=(s,))
    mbarrier.arrive(k_empty.index(stage))
    x, t = _scores(s, row_t, ks_ptr, bias_row, j, rows, NK, DIAGONAL, WINDOW, BN, CAUSAL, WINDOWED, MASKED, EXP,
                   KEY_BIAS)
    m_new = gl.maximum(m_i, gl.ceil(_row_max(x, t, EXP or KEY_BIAS)), propagate_nan=tl.PropagateNan.ALL)
    alpha_new = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_new))
    p = _probability(x, t[:, None], m_new[:, None], EXP, KEY_BIAS)
    if not EARLY:
        part, l_part = warpgroup_mma_wait(0, deps=(part, l_part))
        mbarrier.arrive(v_empty.index(prev))
        acc, l_acc = _accumulate(acc, part, l_acc, l_part, alpha)
    return acc, part, l_acc, l_part, m_new, p, alpha_new


@gluon.jit
def _accumulate(acc, part, l_acc, l_part, alpha):
    """The running sums moved by alpha, plus a tile's products (two-level accumulation)."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None] + part
    l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_acc.type.layout))[:, None] + l_part
    return acc, l_acc


@gluon.jit
def _store_rows(ptr, tile, row0, col0, b, head, N, out_strides):
    """A float32 [rows, columns] tile into ``ptr``'s dtype at rows row0.. and columns
    col0.. of batch ``b``, head ``head``, rows past N left alone.  64-bit offsets:
    B * stride_b may pass 2**31 elements on long sequences."""
    layout: gl.constexpr = tile.type.layout
    rows = row0 + gl.arange(0, tile.shape[0], gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, tile.shape[1], gl.SliceLayout(0, layout))
    offs = (b.to(gl.int64) * out_strides[0] + head * out_strides[1] + rows[:, None] * out_strides[2]
            + cols[None, :] * out_strides[3])
    gl.store(ptr + offs, tile.to(ptr.dtype.element_ty), mask=(rows < N)[:, None])


@gluon.jit
def _consumer(qs_ptr, ks_ptr, vs_ptr, out_ptr, lse_ptr, ref_ptr, bias_row, smem, bars, out_strides, row_strides,
              bh, kv_head, start_m, H, NQ, NK, DIAGONAL, WINDOW, tiles,
              WG: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, EXP: gl.constexpr,
              LIFT: gl.constexpr, EMPTY_ROW: gl.constexpr, KEY_BIAS: gl.constexpr):
    lo, n_iter, full_lo, full_hi = tiles
    q_smem, k_bufs, v_bufs, ones = smem
    q_bar, k_ready, k_empty, v_ready, v_empty, turn = bars
    nw: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _wgmma_layout(BN, nw)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM, nw)
    l_layout: gl.constexpr = _wgmma_layout(ONES_N, nw)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    rows = start_m + WG * BM + gl.arange(0, BM, row_s)
    row_ok = rows < NQ
    row_t = gl.load(qs_ptr + bh * row_strides[0] + rows * row_strides[1], mask=row_ok, other=0.0) \
        * 1.4426950408889634  # LOG2E, rounded to float32 like the reference
    q = q_smem.index(WG).reshape([BM, HEAD_DIM])
    mbarrier.wait(q_bar, 0)
    s_zero = gl.zeros([BM, BN], gl.int32, s_layout)

    # The first tile: scores and P only; each step then overlaps S_j with P_{j-1} V_{j-1}.
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(turn.index(WG), 0)
    s = warpgroup_mma(q, k_bufs.index(0).reshape([BN, HEAD_DIM]).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    mbarrier.arrive(turn.index(1 - WG))
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0))
    x, t = _scores(s, row_t, ks_ptr, bias_row, lo, rows, NK, DIAGONAL, WINDOW, BN, CAUSAL, WINDOWED, True, EXP,
                   KEY_BIAS)
    m_i = gl.ceil(_row_max(x, t, EXP or KEY_BIAS))
    state = (gl.zeros([BM, HEAD_DIM], gl.float32, o_layout), gl.zeros([BM, HEAD_DIM], gl.float32, o_layout),
             gl.zeros([BM, ONES_N], gl.float32, l_layout), gl.zeros([BM, ONES_N], gl.float32, l_layout),
             m_i, _probability(x, t[:, None], m_i[:, None], EXP, KEY_BIAS), gl.full([BM], 1.0, gl.float32, row_s))
    # Tiles lo+1 .. hi-1: unmasked from b1 up to full_hi, masked after (the diagonal, the
    # keys' end, a key bias's last edge tile).  No loop runs before the unmasked one: in a
    # second loop the compiler carries P's codes unpacked and repacks them every tile
    # (~35 % more instructions, docs/perf-notes/2026-12.md, "Key padding in the Gluon
    # forward").  So a window's lower edge, at most
    # tiles lo and lo + 1 (its 128 rows' edges span 128 keys), is the prologue's tile and
    # one more straight-line step (``_fwd_ws`` gives windowed programs two tiles at
    # least; a tile past the visible ones is masked out whole); a key bias's first edge
    # tile is tile lo; and where tiles b1.. are not all unmasked (a bias whose zero run
    # starts later), every tile goes to the last loop.
    hi = lo + n_iter
    b1 = lo + 1
    if WINDOWED:
        state = _step(1, lo + 1, state, q, s_zero, row_t, rows, ks_ptr, bias_row, NK, DIAGONAL, WINDOW, smem, bars,
                      WG, HEAD_DIM, BM, BN, STAGES, CAUSAL, WINDOWED, EXP, True, KEY_BIAS)
        b1 = lo + 2
    if WINDOWED or KEY_BIAS:
        full_hi = gl.where(full_lo <= b1, full_hi, b1)
    b2 = gl.minimum(gl.maximum(full_hi, b1), hi)
    for j in range(b1, b2):
        state = _step(j - lo, j, state, q, s_zero, row_t, rows, ks_ptr, bias_row, NK, DIAGONAL, WINDOW, smem, bars,
                      WG, HEAD_DIM, BM, BN, STAGES, CAUSAL, WINDOWED, EXP, False, KEY_BIAS)
    for j in range(b2, hi):
        state = _step(j - lo, j, state, q, s_zero, row_t, rows, ks_ptr, bias_row, NK, DIAGONAL, WINDOW, smem, bars,
                      WG, HEAD_DIM, BM, BN, STAGES, CAUSAL, WINDOWED, EXP, True, KEY_BIAS)
    acc, part, l_acc, l_part, m_i, p, alpha = state
    last = (n_iter - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_iter - 1) // STAGES) & 1)
    part, l_part = _products(p, v_bufs.index(last), ones, part, l_part, HEAD_DIM, BM, BN)
    part, l_part = warpgroup_mma_wait(0, deps=(part, l_part))
    mbarrier.arrive(v_empty.index(last))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + part
    l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None] + l_part
    l_i = gl.convert_layout(gl.max(l_acc, 1), row_s)  # every column holds the row sum

    # A row that saw no visible key (formats.EMPTY_ROW_LOG2): O = 0, LSE = -inf, reference 0.
    empty = m_i < EMPTY_ROW
    v_scale = gl.load(vs_ptr + kv_head)
    r = gl.convert_layout(gl.div_rn(gl.full([BM], 1.0, gl.float32, row_s) * v_scale, l_i), row_o)
    out = gl.where(gl.convert_layout(empty, row_o)[:, None], 0.0, acc * r[:, None])
    _store_rows(out_ptr, out, start_m + WG * BM, 0, bh // H, bh % H, NQ, out_strides)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_i) - LIFT) * 0.6931471805599453)  # LN2
    row = bh * row_strides[0] + rows * row_strides[1]
    gl.store(lse_ptr + row, lse, mask=row_ok)
    gl.store(ref_ptr + row, gl.where(empty, 0.0, m_i), mask=row_ok)  # backward rebuilds P against it


@gluon.jit
def _producer(q_desc, k_desc, v_desc, smem, bars, bh, start_m, kv_head, lo, n_iter, NK,
              BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    q_smem, k_bufs, v_bufs, ones = smem
    q_bar, k_ready, k_empty, v_ready, v_empty, turn = bars
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [bh, start_m, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [bh, start_m + BM, 0], q_bar, q_smem.index(1))
    for i in range(n_iter):
        s = i % STAGES
        phase = (i // STAGES) & 1
        j = lo + i
        mbarrier.wait(k_empty.index(s), phase ^ 1)  # a fresh barrier counts as released
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        # K in 16-key chunks of all heads in a row (NK % 16 == 0), see _key_order
        tma.async_copy_global_to_shared(k_desc, [kv_head * (NK // 16) + j * (BN // 16), 0, 0, 0, 0],
                                        k_ready.index(s), k_bufs.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_head, 0, j * BN], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _program_tiles(NK, GROUP, DIAGONAL, WINDOW, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
                   WINDOWED: gl.constexpr):
    """A program's first query row (two warpgroups of BM rows), (batch, head), shared K/V
    head (GQA/MQA: H is a multiple of GROUP) and its key tiles (lo, count, full_lo,
    full_hi): tiles lo .. lo + count - 1 hold every key the structure shows any of its rows
    (at least one tile, whose keys may all be hidden), and tiles full_lo .. full_hi - 1
    need no mask, being wholly inside the keys and visible to every row.  Both
    warpgroups walk the same tiles.  Causal: the last query rows walk the most key tiles,
    so they launch first."""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    start_m = pid_m * 2 * BM
    bh = gl.program_id(1)
    tiles = gl.cdiv(NK, BN)
    lo = tiles * 0
    hi = tiles
    full_lo = lo
    full_hi = NK // BN
    if CAUSAL:
        first = start_m + DIAGONAL  # the last key visible to the program's first row
        last = first + 2 * BM - 1  # and to its last
        hi = gl.minimum(gl.cdiv(gl.maximum(last + 1, 0), BN), tiles)
        full_hi = gl.minimum(gl.maximum(first + 1, 0) // BN, full_hi)
        if WINDOWED:
            lo = gl.minimum(gl.maximum(first - WINDOW + 1, 0) // BN, tiles - 1)
            full_lo = gl.cdiv(gl.maximum(last - WINDOW + 1, 0), BN)
    hi = gl.maximum(hi, lo + 1)
    return start_m, bh, bh // GROUP, (lo, hi - lo, full_lo, full_hi)


@gluon.jit
def _key_bias_tiles(tiles, ranges_ptr):
    """``_program_tiles``' tiles narrowed to a key bias row's (``key_bias.tile_ranges`` at
    ``ranges_ptr``): wholly masked tiles skipped, only its zero tiles unmasked.  Where no
    visible tile keeps a key, the first visible tile runs alone (its keys all masked: the
    rows come out with no visible key, as the reference's)."""
    lo, n_iter, full_lo, full_hi = tiles
    kept_lo = gl.maximum(lo, gl.load(ranges_ptr))
    kept_hi = gl.minimum(lo + n_iter, gl.load(ranges_ptr + 1))
    none = kept_hi <= kept_lo
    lo = gl.where(none, lo, kept_lo)
    n_iter = gl.where(none, 1, kept_hi - kept_lo)
    return (lo, n_iter, gl.maximum(full_lo, gl.load(ranges_ptr + 2)), gl.minimum(full_hi, gl.load(ranges_ptr + 3)))


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """The mbarriers of a producer warp and CONSUMERS consumer partitions: one for the
    operands loaded once per program, and ready/empty pairs of two rings of STAGES slots
    (every consumer releases a slot).  Returned as (once, a_ready, a_empty, b_ready, b_empty)."""
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=CONSUMERS)
        mbarrier.init(b_empty.index(i), count=CONSUMERS)
    return once, a_ready, a_empty, b_ready, b_empty


@gluon.jit
def _ping_pong_barriers(STAGES: gl.constexpr):
    """``_ring_barriers`` and the warpgroups' turns on the tensor cores, warpgroup 0 first.
    Returned as (once, a_ready, a_empty, b_ready, b_empty, turn)."""
    once, a_ready, a_empty, b_ready, b_empty = _ring_barriers(STAGES)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.arrive(turn.index(0))
    return once, a_ready, a_empty, b_ready, b_empty, turn


@gluon.jit
def _fwd_ws(q_desc, k_desc, v_desc, qs_ptr, ks_ptr, vs_ptr, out_ptr, lse_ptr, ref_ptr, bias_ptr, ranges_ptr,
            stride_ob, stride_oh, stride_om, stride_od, stride_rb, stride_rm, stride_ksb, bias_row_b, bias_row_h,
            H, GROUP, NQ, NK, DIAGONAL, WINDOW,
            HEAD_DIM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
            WINDOWED: gl.constexpr, EXP: gl.constexpr, LIFT: gl.constexpr, EMPTY_ROW: gl.constexpr,
            KEY_BIAS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[1]
    start_m, bh, kv_head, tiles = _program_tiles(NK, GROUP, DIAGONAL, WINDOW, BM, BN, CAUSAL, WINDOWED)
    bias_row = bias_ptr
    if KEY_BIAS:
        row = (bh // H) * bias_row_b + (bh % H) * bias_row_h
        tiles = _key_bias_tiles(tiles, ranges_ptr + row * 4)
        bias_row = bias_ptr + row.to(gl.int64) * NK
    if WINDOWED:  # the consumers' second step is straight-line code (``_consumer``)
        tiles = (tiles[0], gl.maximum(tiles[1], 2), tiles[2], tiles[3])
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    bars = _ping_pong_barriers(STAGES)  # (q_bar, k_ready, k_empty, v_ready, v_empty, turn)

    # Ones for the row sums, [8, BN] K-major like V^T; written once, before the partitions.
    ones = gl.allocate_shared_memory(gl.float8e4nv, [ONES_N, BN],
                                     gl.NVMMASharedLayout.get_default_for([ONES_N, BN], gl.float8e4nv))
    fill: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
    ones.store(gl.full([ONES_N, BN], E4M3_ONE, gl.uint8, fill).to(gl.float8e4nv, bitcast=True))
    fence_async_shared()
    gl.thread_barrier()

    smem = (q_smem, k_bufs, v_bufs, ones)
    out_strides = (stride_ob, stride_oh, stride_om, stride_od)
    row_strides = (stride_rb, stride_rm)
    ks_head = ks_ptr + kv_head * stride_ksb
    gl.warp_specialize([
        (_consumer, (qs_ptr, ks_head, vs_ptr, out_ptr, lse_ptr, ref_ptr, bias_row, smem, bars, out_strides,
                     row_strides, bh, kv_head, start_m, H, NQ, NK, DIAGONAL, WINDOW, tiles, 0, HEAD_DIM, BM, BN,
                     STAGES, CAUSAL, WINDOWED, EXP, LIFT, EMPTY_ROW, KEY_BIAS)),
        (_consumer, (qs_ptr, ks_head, vs_ptr, out_ptr, lse_ptr, ref_ptr, bias_row, smem, bars, out_strides,
                     row_strides, bh, kv_head, start_m, H, NQ, NK, DIAGONAL, WINDOW, tiles, 1, HEAD_DIM, BM, BN,
                     STAGES, CAUSAL, WINDOWED, EXP, LIFT, EMPTY_ROW, KEY_BIAS)),
        (_producer, (q_desc, k_desc, v_desc, smem, bars, bh, start_m, kv_head, tiles[0], tiles[1], NK, BM, BN,
                     STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def supports(q, k, v_t, q_scale, bias, p_mode, lse, row_ref) -> bool:
    """Whether this kernel can compute the call (module docstring); which calls it gets is
    decided by ``kernels._forward``."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    rows = (h * nq, nq, 1)
    return (p_mode in ("direct", "exp") and (bias is None or key_row_bias(bias, b, h, nq, nk))
            and d in (64, 128) and k.shape[-1] == d and tuple(v_t.shape[-2:]) == (d, nk)
            and b * h > 0 and nq > 0 and nk > 0 and nk % 16 == 0
            and h % hkv == 0 and b * h < 65536  # the grid's second dimension
            and q.dtype == k.dtype == torch.int8 and v_t.dtype == F.E4M3
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v_t))  # TMA
            and all(t.stride() == rows for t in (q_scale, lse, row_ref))  # indexed alike in the kernel
            and h * nq * d < 2**31)  # output offsets within a batch are 32-bit (the batch's is 64)


def _layout(block, dtype):
    """The shared-memory layout of a TMA block: cached, as every launch asks for its
    blocks' layouts and Gluon builds one in ~7 us of Python."""
    return _default_layout(tuple(block), dtype)


@functools.lru_cache(maxsize=None)
def _default_layout(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _constexprs(d: int, causal: bool, p_mode: str, windowed: bool = False, key_bias: bool = False) -> dict:
    return dict(HEAD_DIM=d, BN=BLOCK_N, STAGES=NUM_STAGES, CAUSAL=bool(causal), WINDOWED=bool(causal and windowed),
                EXP=p_mode == "exp", LIFT=F.p_lift(p_mode), EMPTY_ROW=F.EMPTY_ROW_LOG2, KEY_BIAS=key_bias, **_REGS)


def attention_forward(q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out, lse, row_ref, diagonal=0,
                      window=0):
    """The Triton launcher's contract, for the calls ``supports`` accepts: the causal
    structure of ``formats.visible`` (``diagonal``, ``window``) too, and key-padding
    biases (``key_bias``)."""
    assert supports(q, k, v_t, q_scale, bias, p_mode, lse, row_ref)
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    bias_rows, ranges, row_b, row_h = launch_rows(KeyRows.of(bias, b, h, nq, nk), BLOCK_N, q_scale)
    q_block, k_block, v_block = [1, BM_WG, d], [BLOCK_N // 16, 2, 4, 2, d], [1, d, BLOCK_N]
    q_desc = TensorDescriptor.from_tensor(q.view(b * h, nq, d), q_block, _layout(q_block, gl.int8))
    # K as [16-key chunks of all heads, jl, q, b, D]: see _key_order.
    k_desc = TensorDescriptor(k, [b * hkv * nk // 16, 2, 4, 2, d], [16 * d, 2 * d, 4 * d, d, 1], k_block,
                              _layout(k_block, gl.int8))
    v_desc = TensorDescriptor.from_tensor(v_t.view(b * hkv, d, nk), v_block, _layout(v_block, gl.float8e4nv))
    k_scale, v_scale = k_scale.float().reshape(b * hkv, -1), v_scale.float().reshape(-1)
    _fwd_ws[(triton.cdiv(nq, 2 * BM_WG), b * h)](
        q_desc, k_desc, v_desc, q_scale.float(), k_scale, v_scale, out, lse, row_ref, bias_rows, ranges,
        *out.stride(), lse.stride(1), lse.stride(2), k_scale.stride(0), row_b, row_h, h, h // hkv, nq, nk,
        int(diagonal) if causal else 0, int(window) if causal else 0,
        **_constexprs(d, causal, p_mode, bool(window), bias is not None), **_LAUNCH)


def _tensor_desc(dt: str, block: list[int], dtype) -> str:
    """A tensor descriptor's type in a compile signature (``_compile_sm90``)."""
    return f"tensordesc<{dt}[{', '.join(map(str, block))}],{_layout(block, dtype)!r}>"


def _compile_sm90(kernel, sig: dict, consts: dict, launch: dict = _LAUNCH):
    """Compile a kernel of this family for sm_90 without a GPU (Triton's bundled ptxas),
    with launch options ``launch``: ``sig`` types its pointer and descriptor arguments;
    the rest are constexprs where ``consts`` names them, else i32."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(sig, **{name: "constexpr" if name in consts else "i32" for name in kernel.arg_names if name not in sig})
    return triton.compile(GluonASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=launch)


def compile_for_sm90(d: int, causal: bool, p_mode: str = "direct", windowed: bool = False, key_bias: bool = False):
    """Compile without a GPU (Triton's bundled ptxas), for inspection: the compiled kernel."""
    sig = {"q_desc": _tensor_desc("i8", [1, BM_WG, d], gl.int8),
           "k_desc": _tensor_desc("i8", [BLOCK_N // 16, 2, 4, 2, d], gl.int8),
           "v_desc": _tensor_desc("fp8e4nv", [1, d, BLOCK_N], gl.float8e4nv), "qs_ptr": "*fp32", "ks_ptr": "*fp32",
           "vs_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "ref_ptr": "*fp32", "bias_ptr": "*fp32",
           "ranges_ptr": "*i32"}
    return _compile_sm90(_fwd_ws, sig, _constexprs(d, causal, p_mode, windowed, key_bias))
