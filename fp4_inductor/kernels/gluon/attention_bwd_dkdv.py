"""Warp-specialised Hopper (sm_90) dK/dV kernel in Gluon, P mode ``direct``, D = 64 and 128.

The dK/dV half of ``kernels/triton/attention_bwd.py`` in the Gluon dQ kernel's structure:
one program per 128 keys of one K/V head (one K scale block), a producer warp streaming
the query side through a two-stage ring, and the consumers: at D = 128 two warpgroups of
64 keys each that issue to the tensor cores without taking turns (as in the dQ kernel), at
D = 64 one 8-warp partition over the 128 keys, which compiles the step once instead of
twice (``_consumers``).  The ring holds, per query tile (``formats.ds_block_dk``: 128
queries at D = 64, 64 at D = 128), the Q and dO rows (B operands of the scores and of dP),
their token-major Qeᵀ and dOᵀ tiles (B operands of the gradient products) and the tile's
per-query vectors (q_scale·log2e, Direct-P bias of the row reference, delta), which a
transposed tile needs per column: loaded by TMA ahead of use, not by each consumer thread
after its scores.  Per tile and consumer, on transposed tiles [keys, queries]:

  Sᵀ = K·Qᵀ (INT8, exact),  dPᵀ = V·dOᵀ (E4M3 × E5M2),
  Pᵀ = Direct-P codes against the forward's row references (one per query, a column),
  dSᵀ = Pᵀ ∘ (dPᵀ·do_scale·v_scale − delta) → E4M3 with one amax scale per key over the
  step's queries (``formats.ds_block_dk``: 128 at D = 64, 64 at D = 128; a reduction
  within a row's four threads),
  dV += (Pᵀ·dO)·do_scale and dK += (dSᵀ·Qe)·(ds_scale_key·qe_scale), each product summed in
  float32 as the Triton kernel does (same numbers).

A consumer issues its products one after the other, only dV's first column half running
while dSᵀ is computed, so its accumulators are dK, dV's two halves and one part of each
product: at D = 128 the other warpgroup's scores overlap them.  Issuing a tile's products
under the next tile's scores instead kept four [64, D] float32 accumulators live and
spilled: 0.68-0.72x (D = 64) and 0.21-0.26x (D = 128) this order's speed on the H200
(docs/perf-notes/2026-11.md, "Branch experiments measured (H200, 2026-11-30 00:30 UTC)").

The query tiles of the GQA group's heads run one after the other in one sequence, so dK
and dV are summed over the group without atomics.  The Q and dO rows of a tile arrive in
the P-operand order (``_permuted_rows``, as K's in the dQ kernel), so Pᵀ and dSᵀ are their
own A operands (a relabelling of registers, no shuffles).  Only tiles that cross the
causal diagonal or the end of the keys or queries are masked: a runtime branch per step
between two compiled copies of the Pᵀ codes, joined before dSᵀ, whose code both share.
dV's product runs in two column halves, the first issued before dSᵀ is computed so that
it runs under that work (a whole [64, 128] part live next to dSᵀ's temporaries spills).

Scope (``supports``): P mode direct, no bias or a key-row bias, D = 64 or 128.  K and V contiguous, Q and
dO any layout (``_padded_rows`` copies them where they are not contiguous rows in whole
tiles), token-major dOᵀ and Qeᵀ as ``attention_bwd_prep`` makes them; the per-query vectors
are stacked by the launcher (``_row_vectors``), any layout.

A key-row bias (key padding, ``KEY_BIAS``): a program whose keys every head of its group
masks wholly (``key_bias.tile_ranges``) walks no query tile (dK = dV = 0); the others add
each key's bias in the scores' FMA, as the Triton kernel does (a zero bias gives the
reference's rounded product).  Measured on the H200 with the dQ kernel's (its module
docstring).
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
from .attention_bwd_dq import _ds_operand, _issue_s_dp, _permuted_rows, _rows, _tma_ready, _token_major_desc
from .attention_fwd import (_LAUNCH, _REGS, _compile_sm90, _direct_p, _direct_p_bias, _key_order, _layout,
                            _p_operand, _ring_barriers, _store_rows, _tensor_desc, _wgmma_layout)

BLOCK_N = F.KEY_TILE  # keys per program: one K scale block
BN_LOAD = BLOCK_N // 2  # keys per K/V TMA load, two per program
NUM_STAGES = 2
# Key-row biases (module docstring); off sends them to the Triton kernel (A/B runs).
KEY_BIAS = True


@gluon.jit
def _p_tile(start_m, s, keys, vecs, NQ, NK, ks, key_bias, BM: gl.constexpr, CAUSAL: gl.constexpr,
            MASKED: gl.constexpr, KEY_BIAS: gl.constexpr):
    """Pᵀ codes of the query tile at ``start_m`` from its scores and its row vectors in
    shared memory (``vecs``: q_scale·log2e, Direct-P bias, delta).  MASKED: keys past NK,
    queries past NQ and (causal) keys after the query masked; else the tile is known whole.
    KEY_BIAS: ``key_bias``, the keys' log2 biases, join the scores in one FMA."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s.type.layout)
    if KEY_BIAS:  # the log2 scores s t + bias, rounded once (the reference's), then Direct-P
        x = gl.fma(s.to(gl.float32), (vecs[0].load(col_layout) * ks)[None, :], key_bias[:, None])
        t32 = gl.full([BM], 0.03125, gl.float32, col_layout)
    else:
        # t / 32 = rn(q_scale log2e * ks) / 32, the reference's row * col (a power of two
        # commutes with the rounding): one multiply a column, folded into Direct-P's FFMA.
        t32 = vecs[0].load(col_layout) * (ks * 0.03125)
        x = s.to(gl.float32)
    if MASKED:  # columns past NQ hold zeros: -inf * t32 = NaN there, which FFMA.SAT makes code 0
        cols = start_m + _key_order(BM, col_layout)
        live = (keys < NK)[:, None] & (cols < NQ)[None, :]
        if CAUSAL:
            live = live & (keys[:, None] <= cols[None, :])
        x = gl.where(live, x, float("-inf"))
    return _direct_p(x, t32[None, :], vecs[1].load(col_layout)[None, :])


@gluon.jit
def _ds_tile(h, start_m, p8, dp, vecs, do_scale, qes_ptr, b, H, v_scale, stride_qes):
    """dSᵀ operand of the query tile at ``start_m`` of head ``h`` from its Pᵀ codes and
    dPᵀ (``do_scale``: the head's), and the per-key scales of its dK product."""
    dov_scale = do_scale * v_scale
    delta = vecs[2].load(gl.SliceLayout(0, dp.type.layout))
    ds8, ds_scale = _ds_operand(p8.to(gl.float32), dp, delta[None, :], dov_scale)
    qe_scale = gl.load(qes_ptr + (b * H + h) * stride_qes + start_m // 128)  # formats.SCALE_BLOCK
    return ds8, ds_scale * qe_scale


@gluon.jit
def _consumer(args, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, KEY_BIAS: gl.constexpr):
    """Consumer WG, of the program's keys WG·BN .. WG·BN + BN - 1."""
    dos_ptr, vs_ptr, qes_ptr, dk_ptr, dv_ptr, smem, bars, out_strides, stride_qes, ks, b, kv_head, H, GROUP, k0, \
        j_lo, n_q, NQ, NK, bias_ptr, bias_rows = args
    k_smem, v_smem, q_bufs, do_bufs, dot_bufs, qet_bufs, row_bufs = smem
    kv_bar, q_ready, q_empty, t_ready, t_empty = bars
    nw: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _wgmma_layout(BM, nw)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM, nw)
    keys = k0 + WG * BN + gl.arange(0, BN, gl.SliceLayout(1, s_layout))
    last_key = k0 + WG * BN + BN - 1
    v_scale = gl.load(vs_ptr + b * (H // GROUP) + kv_head)
    KEYS: gl.constexpr = k_smem.shape[2]  # the program's
    k_op = k_smem.reshape([KEYS, HEAD_DIM]).slice(WG * BN, BN)
    v_op = v_smem.reshape([KEYS, HEAD_DIM]).slice(WG * BN, BN)
    dk = gl.zeros([BN, HEAD_DIM], gl.float32, o_layout)
    HALF: gl.constexpr = HEAD_DIM // 2
    h_layout: gl.constexpr = _wgmma_layout(HALF, nw)
    dv_lo = gl.zeros([BN, HALF], gl.float32, h_layout)
    dv_hi = gl.zeros([BN, HALF], gl.float32, h_layout)
    n_steps = GROUP * n_q
    # Also where no query tile sees these keys (causal, n_steps = 0): the program must not
    # exit while the producer's K and V loads still write its shared memory.
    mbarrier.wait(kv_bar, 0)
    # One part of each product (dK's, dV's half), none in flight while the scores are
    # converted to Pᵀ: issuing a tile's products under the next tile's scores kept more
    # accumulators live and spilled; at D = 128 the other warpgroup's scores keep the tensor
    # cores busy while this one waits on its products.
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    part = gl.zeros([BN, HEAD_DIM], gl.float32, o_layout)
    ha_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=h_layout, k_width=4)
    v_part = gl.zeros([BN, HALF], gl.float32, h_layout)
    for c in range(n_steps):
        stage = c % STAGES
        phase = (c // STAGES) & 1
        key_bias = 0.0
        if KEY_BIAS:  # the step's head's biases at these keys (two a thread), loaded under its products
            row = (b * bias_rows[0] + (kv_head * GROUP + c // n_q) * bias_rows[1]).to(gl.int64) * NK
            key_bias = gl.load(bias_ptr + row + keys, mask=keys < NK, other=0.0)
        mbarrier.wait(q_ready.index(stage), phase)
        s, dp = _issue_s_dp(k_op, q_bufs.index(stage).reshape([BM, HEAD_DIM]), v_op,
                            do_bufs.index(stage).reshape([BM, HEAD_DIM]), BN, BM, s_layout)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        mbarrier.arrive(q_empty.index(stage))
        h = kv_head * GROUP + c // n_q  # step c: query tile j_lo + c % n_q of the group's head c // n_q
        start_m = (j_lo + c % n_q) * BM
        do_scale = gl.load(dos_ptr + b * H + h)  # the query head's dO scale
        mbarrier.wait(t_ready.index(stage), phase)  # also the row vectors, read by _p_tile and _ds_tile
        vecs = (row_bufs[0].index(stage), row_bufs[1].index(stage), row_bufs[2].index(stage))
        whole = (start_m + BM <= NQ) & (last_key < NK)
        if CAUSAL:
            whole = whole & (last_key <= start_m)
        # An unmasked copy of Pᵀ for whole tiles: 6-11 % faster dK/dV (perf-notes).
        if whole:
            p8 = _p_tile(start_m, s, keys, vecs, NQ, NK, ks, key_bias, BM, CAUSAL, False, KEY_BIAS)
        else:
            p8 = _p_tile(start_m, s, keys, vecs, NQ, NK, ks, key_bias, BM, CAUSAL, True, KEY_BIAS)
        # dV's product in two column halves, the first under dSᵀ's work (module docstring).
        pa = _p_operand(p8, ha_layout, BN, BM)
        dot = dot_bufs.index(stage).reshape([HEAD_DIM, BM])
        v_part = warpgroup_mma(pa, dot.slice(0, HALF).permute((1, 0)), v_part, use_acc=False, is_async=True)
        ds8, scale = _ds_tile(h, start_m, p8, dp, vecs, do_scale, qes_ptr, b, H, v_scale, stride_qes)
        v_part = warpgroup_mma_wait(0, deps=(v_part,))
        dv_lo = dv_lo + v_part * do_scale
        v_part = warpgroup_mma(pa, dot.slice(HALF, HALF).permute((1, 0)), v_part, use_acc=False, is_async=True)
        v_part = warpgroup_mma_wait(0, deps=(v_part,))
        dv_hi = dv_hi + v_part * do_scale
        part = warpgroup_mma(_p_operand(ds8, a_layout, BN, BM), qet_bufs.index(stage).reshape([HEAD_DIM, BM])
                             .permute((1, 0)), part, use_acc=False, is_async=True)
        part = warpgroup_mma_wait(0, deps=(part,))
        mbarrier.arrive(t_empty.index(stage))
        dk = dk + part * _rows(scale, dk)

    row0 = k0 + WG * BN
    _store_rows(dk_ptr, dk, row0, 0, b, kv_head, NK, out_strides)
    _store_rows(dv_ptr, dv_lo, row0, 0, b, kv_head, NK, out_strides)
    _store_rows(dv_ptr, dv_hi, row0, HALF, b, kv_head, NK, out_strides)


@gluon.jit
def _producer(args, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    k_desc, v_desc, q_desc, do_desc, dot_desc, qet_desc, row_desc, smem, bars, b, kv_head, H, GROUP, k0, j_lo, n_q, \
        NQ_PAD = args
    k_smem, v_smem, q_bufs, do_bufs, dot_bufs, qet_bufs, row_bufs = smem
    kv_bar, q_ready, q_empty, t_ready, t_empty = bars
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, kv_head, k0 + w * BN, 0], kv_bar, k_smem.slice(w * BN, BN, dim=2))
        tma.async_copy_global_to_shared(v_desc, [b, kv_head, k0 + w * BN, 0], kv_bar, v_smem.slice(w * BN, BN, dim=2))
    for c in range(GROUP * n_q):
        h = kv_head * GROUP + c // n_q
        start_m = (j_lo + c % n_q) * BM
        s = c % STAGES
        phase = (c // STAGES) & 1
        mbarrier.wait(q_empty.index(s), phase ^ 1)  # a fresh barrier counts as released
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        chunk = ((b * H + h) * NQ_PAD + start_m) // 16  # _padded_rows
        tma.async_copy_global_to_shared(q_desc, [chunk, 0, 0, 0, 0], q_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [chunk, 0, 0, 0, 0], q_ready.index(s), do_bufs.index(s))
        mbarrier.wait(t_empty.index(s), phase ^ 1)
        mbarrier.expect(t_ready.index(s), dot_desc.block_type.nbytes + qet_desc.block_type.nbytes
                        + 3 * row_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(dot_desc, [b * H + h, 0, start_m], t_ready.index(s), dot_bufs.index(s))
        tma.async_copy_global_to_shared(qet_desc, [b * H + h, 0, start_m], t_ready.index(s), qet_bufs.index(s))
        for i in gl.static_range(3):
            tma.async_copy_global_to_shared(row_desc, [((b * H + h) * 3 + i) * NQ_PAD + start_m], t_ready.index(s),
                                            row_bufs[i].index(s))


@gluon.jit
def _dkdv_ws(k_desc, v_desc, q_desc, do_desc, dot_desc, qet_desc, row_desc, ks_ptr, vs_ptr,
             dos_ptr, qes_ptr, dk_ptr, dv_ptr, bias_ptr, ranges_ptr, stride_ob, stride_oh, stride_on, stride_od,
             stride_ksh, stride_qes, bias_row_b, bias_row_h, H, HKV, NQ, NK, NQ_PAD,
             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr,
             KEY_BIAS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BN: gl.constexpr = k_desc.block_type.shape[2]  # BN_LOAD
    BM: gl.constexpr = 16 * q_desc.block_type.shape[0]
    # Causal: the first keys see the most query tiles; launch them first (they are pid 0).
    k0 = gl.program_id(0) * 2 * BN
    b = gl.program_id(1) // HKV
    kv_head = gl.program_id(1) % HKV
    GROUP = H // HKV
    # Causal (top-left): query tiles wholly before this program's first key see none of it.
    j_lo = k0 // BM if CAUSAL else 0
    n_q = gl.maximum(gl.cdiv(NQ, BM) - j_lo, 0)
    if KEY_BIAS:  # keys that every head of the group masks see no query (dK = dV = 0)
        kept = False
        for g in range(GROUP):
            ranges = ranges_ptr + (b * bias_row_b + (kv_head * GROUP + g) * bias_row_h) * 4
            kept = kept | ((gl.program_id(0) >= gl.load(ranges)) & (gl.program_id(0) < gl.load(ranges + 1)))
        n_q = gl.where(kept, n_q, 0)
    ks = gl.load(ks_ptr + b * (HKV * stride_ksh) + kv_head * stride_ksh + gl.program_id(0))

    kv_shape: gl.constexpr = [1, 1, 2 * BN, HEAD_DIM]  # the program's keys, one tile
    k_smem = gl.allocate_shared_memory(k_desc.dtype, kv_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, kv_shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    dot_bufs = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape, dot_desc.layout)
    qet_bufs = gl.allocate_shared_memory(qet_desc.dtype, [STAGES] + qet_desc.block_type.shape, qet_desc.layout)
    row_bufs = (gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_desc.layout),
                gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_desc.layout),
                gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_desc.layout))
    bars = _ring_barriers(STAGES, CONSUMERS)  # (kv_bar, q_ready, q_empty, t_ready, t_empty)

    smem = (k_smem, v_smem, q_bufs, do_bufs, dot_bufs, qet_bufs, row_bufs)
    out_strides = (stride_ob, stride_oh, stride_on, stride_od)  # dK's and dV's
    args = (dos_ptr, vs_ptr, qes_ptr, dk_ptr, dv_ptr, smem, bars, out_strides, stride_qes, ks, b, kv_head, H, GROUP,
            k0, j_lo, n_q, NQ, NK, bias_ptr, (bias_row_b, bias_row_h))
    loads = (k_desc, v_desc, q_desc, do_desc, dot_desc, qet_desc, row_desc, smem, bars, b, kv_head, H, GROUP, k0,
             j_lo, n_q, NQ_PAD)
    if CONSUMERS == 1:
        gl.warp_specialize([(_consumer, (args, 0, HEAD_DIM, BM, 2 * BN, STAGES, CAUSAL, KEY_BIAS)),
                            (_producer, (loads, BM, BN, STAGES))], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (args, 0, HEAD_DIM, BM, BN, STAGES, CAUSAL, KEY_BIAS)),
                            (_consumer, (args, 1, HEAD_DIM, BM, BN, STAGES, CAUSAL, KEY_BIAS)),
                            (_producer, (loads, BM, BN, STAGES))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_CONSTEXPRS = dict(STAGES=NUM_STAGES, **_REGS)


def _consumers(d: int) -> tuple[dict, dict]:
    """The constexprs and launch options of head dim ``d``: at D = 64 one 8-warp consumer
    partition over the program's 128 keys, whose step is compiled once (two 4-warp ones
    inline it twice, and their warps stalled on instruction fetch: one partition takes
    0.90x-0.97x their time on the H200); at D = 128 two 4-warp ones of 64 keys, each
    waiting on its products while the other's run (one partition: 1.14x-1.16x)."""
    consumers = 1 if d == 64 else 2
    return dict(_CONSTEXPRS, CONSUMERS=consumers), dict(_LAUNCH, num_warps=8 // consumers)


def _row_vectors(q_scale, row_ref, delta, bm):
    """The per-query vectors of a transposed tile, q_scale·log2e (the reference's row), the
    row reference's Direct-P bias and delta, stacked [B, H, 3, Nq'] and read flat by TMA in
    tiles of ``bm`` queries: a descriptor and Nq'.  Nq' rounds Nq up to bm with zeros, so each
    tile starts 256-byte aligned and in bounds, and columns past Nq read zeros (finite, and
    masked).  The bias is computed here once per query, not per thread and step: a thread
    holds 16 columns of a 64-query tile, so in the kernel it cost 32 instructions a step."""
    vectors = (q_scale * F.LOG2E, _direct_p_bias.fn(row_ref), delta)
    if q_scale.shape[-1] % bm:
        vectors = [torch.nn.functional.pad(v, (0, -v.shape[-1] % bm)) for v in vectors]
    # Each 16 queries in the order of the Q and dO rows (_key_order): position 8jl + 2q + b
    # holds query 4q + 2jl + b.  The stack writes that order in its one copy.
    rows = torch.stack([v.unflatten(-1, (-1, 4, 2, 2)).transpose(-3, -2) for v in vectors], dim=2).flatten(-4)
    return TensorDescriptor(rows, [rows.numel()], [1], [bm], _layout([bm], gl.float32)), rows.shape[-1]


def _padded_rows(t, bm):
    """[B, H, N, D] ``t`` contiguous with N rounded up to ``bm`` by zero rows (a copy only
    where it is not so already): Q and dO as the kernel reads them, a tile of bm rows in
    P-operand order (``_permuted_rows``) from one head, zeros past N, as the tiles of the
    flat row vectors (``_row_vectors``)."""
    if t.is_contiguous() and t.shape[2] % bm == 0 and t.data_ptr() % 16 == 0:
        return t
    padded = t.new_zeros(*t.shape[:2], triton.cdiv(t.shape[2], bm) * bm, t.shape[3])
    padded[:, :, :t.shape[2]] = t
    return padded


def supports(do, do_t, do_scale, delta, q, qe_t, qe_scale, k, v, q_scale, k_scale, v_scale, row_ref, causal, dk, dv,
             bias, p_mode) -> bool:
    """Whether this kernel can compute the call (module docstring).  Arguments as
    ``dkdv_backward``, then the call's bias and P mode."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    return (p_mode == "direct" and (bias is None or KEY_BIAS and key_row_bias(bias, b, h, nq, nk))
            and d in (64, 128) and nq > 0 and nk > 0
            and h % hkv == 0 and b * hkv < 65536  # the grid's second dimension
            and q.dtype == k.dtype == torch.int8 and do.dtype == do_t.dtype == F.E5M2
            and v.dtype == qe_t.dtype == F.E4M3
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (k, v))
            and all(_tma_ready(t) for t in (do_t, qe_t))
            and all(t.stride(0) == h * t.stride(1) for t in (do_t, qe_t))  # [B*H, D, N] views
            and all(t.is_contiguous() for t in (qe_scale, k_scale, v_scale, do_scale))
            and all(t.shape == (b, h, nq) and t.dtype == torch.float32 for t in (q_scale, row_ref, delta))
            and dk.stride() == dv.stride() and all(st >= 0 for st in dk.stride())
            and b * h * 3 * (nq + 127) < 2**31  # the row vectors' 32-bit TMA coordinates
            # dK/dV offsets within a batch are 32-bit (the batch's is 64)
            and sum((n - 1) * st for n, st in zip(dk.shape[1:], dk.stride()[1:])) < 2**31)


def dkdv_backward(do, do_t, do_scale, delta, q, qe_t, qe_scale, k, v, q_scale, k_scale, v_scale, row_ref, causal,
                  dk, dv, key_rows=None):
    """dK, dV into ``dk``, ``dv`` [B, Hkv, Nk, D] (one stride set for both).  ``v`` is V
    row-major [B, Hkv, Nk, D]; ``do_t``, ``qe_t`` token-major; ``key_rows`` the call's
    ``key_bias.KeyRows`` (a key-row bias) or None; the rest as
    ``reference.attention_backward``, float32 scales and rows."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    bias_rows, ranges, row_b, row_h = launch_rows(key_rows, BLOCK_N, row_ref)
    bm = F.ds_block_dk(d)[0]  # queries per step = the queries of one dS scale
    kv_block = [1, 1, BN_LOAD, d]
    k_desc = TensorDescriptor.from_tensor(k, kv_block, _layout(kv_block, gl.int8))
    v_desc = TensorDescriptor.from_tensor(v, kv_block, _layout(kv_block, gl.float8e4nv))
    q_desc = _permuted_rows(_padded_rows(q, bm), bm, gl.int8)
    do_desc = _permuted_rows(_padded_rows(do, bm), bm, gl.float8e5)
    row_desc, nq_pad = _row_vectors(q_scale, row_ref, delta, bm)
    consts, launch = _consumers(d)
    _dkdv_ws[(triton.cdiv(nk, BLOCK_N), b * hkv)](
        k_desc, v_desc, q_desc, do_desc, _token_major_desc(do_t, bm, gl.float8e5),
        _token_major_desc(qe_t, bm, gl.float8e4nv), row_desc,
        k_scale, v_scale, do_scale, qe_scale, dk, dv, bias_rows, ranges,
        *dk.stride(), k_scale.stride(1), qe_scale.stride(1), row_b, row_h, h, hkv, nq, nk, nq_pad,
        HEAD_DIM=d, CAUSAL=bool(causal), KEY_BIAS=key_rows is not None, **consts, **launch)


def compile_for_sm90(d: int, causal: bool, key_bias: bool = False):
    """Compile without a GPU (Triton's bundled ptxas), for inspection: the compiled kernel."""
    bm = F.ds_block_dk(d)[0]
    sig = {"k_desc": _tensor_desc("i8", [1, 1, BN_LOAD, d], gl.int8),
           "v_desc": _tensor_desc("fp8e4nv", [1, 1, BN_LOAD, d], gl.float8e4nv),
           "q_desc": _tensor_desc("i8", [bm // 16, 2, 4, 2, d], gl.int8),
           "do_desc": _tensor_desc("fp8e5", [bm // 16, 2, 4, 2, d], gl.float8e5),
           "dot_desc": _tensor_desc("fp8e5", [1, d, bm], gl.float8e5),
           "qet_desc": _tensor_desc("fp8e4nv", [1, d, bm], gl.float8e4nv),
           "row_desc": _tensor_desc("fp32", [bm], gl.float32), "dk_ptr": "*bf16", "dv_ptr": "*bf16",
           "ranges_ptr": "*i32"}
    for name in ("ks_ptr", "vs_ptr", "dos_ptr", "qes_ptr", "bias_ptr"):
        sig[name] = "*fp32"
    consts, launch = _consumers(d)
    return _compile_sm90(_dkdv_ws, sig, dict(consts, HEAD_DIM=d, CAUSAL=causal, KEY_BIAS=key_bias), launch)
