"""One-kernel FP8 backward for Hopper (sm_90) in Gluon, FlashAttention-3's structure, D = 64 and 128.

The dK/dV kernel's program (``attention_bwd_dkdv.py``: 128 keys of one K/V head, a
producer warp streaming the query side through a two-stage ring, two consumer warpgroups
of 64 keys) computes dQ too, so S, P, dP and dS are made once instead of twice
(``reference.fused_attention_backward`` is its numerics).  Per step of queries
(``formats.ds_block_dk``: 64 at D = 128, 128 at D = 64) and consumer, on transposed tiles
[keys, queries]:

  Sᵀ = K·Qᵀ (INT8, exact),  dPᵀ = V·dOᵀ (E4M3 × E4M3),  Pᵀ = Direct-P codes,
  dSᵀ = Pᵀ ∘ (dPᵀ·do_scale·v_scale − delta)                       (float32, registers)
  dV += Pᵀ·dO             accumulated by the wgmma, in units of the head's dO scale (dO in
        E4M3, not the two kernels' E5M2: its third mantissa bit takes dV's error from
        0.06 to 0.04 against fp64, dQ's and dK's from 0.067 to 0.049, priced on the CPU);
  dS16 = bf16(dSᵀ·ke_scale)   written once to shared memory, the operand of both 16-bit
        products (a 16-bit wgmma takes it either way round: no transpose, no E4M3 copy),
        ``ke_scale`` the key block's INT8 scale times the softmax scale;
  dK += dS16·bf16(Q)      accumulated by the wgmma in float32, Q's values from the
        forward's INT8 codes (the E4M3 dS and Qe of the first versions cost dK 0.0775-0.079
        against fp64 on the H100; these numerics price at 0.87-0.91x the two kernels' error);
  dQ  = dS16·K8           a step later (``_consumer``), both warpgroups' 128 keys times
        one half of the columns of K's INT8 codes (as bf16, exact: the forward's K, not an
        E4M3 copy of it, priced at 0.89-0.91x the E4M3 copy's dQ error); the [queries, D / 2] partial,
        rounded to bf16, goes to shared memory and a TMA reduce-add sums it into dQ itself
        (bf16 sums over the key blocks: +1e-4 to 3e-4 rel-L2 in dQ, priced on the CPU).

Versus the two kernels: no dQ kernel recomputing S, P and dP (38-43 % of the backward's
kernel time), no two-level sums for dK and dV (4 instructions a score and 96 registers at
D = 128), no token-major Keᵀ or Qeᵀ, and no E4M3 copies of Q and K at all: the backward
graph hands this kernel the forward's codes (``kernels.fused_backward_applies``).  Measured
on an H100 (``docs/perf-notes/2026-12.md``, "v3 and D = 64 measured"), the version with E4M3 dK and Ke ran 1.09-1.18x
the two kernels at D = 128; this one is not measured yet.

Scope (``covers`` and ``supports``): P mode direct, D = 64 or 128, no bias, SDPA's causal
structure or none, GQA; the other calls keep the two kernels (``kernels._backward``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as ttgl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import formats as F
from ..triton.attention_bwd_prep import _token_major_empty, _transpose_all
from .attention_bwd_dkdv import _p_tile, _padded_rows, _row_vectors
from .attention_bwd_dq import _issue_s_dp, _permuted_rows, _token_major_desc
from .attention_fwd import _REGS, _compile_sm90, _layout, _p_operand, _store_rows, _tensor_desc, _wgmma_layout

BLOCK_N = F.KEY_TILE  # keys per program: one K scale block
BN_WG = BLOCK_N // 2  # keys per consumer warpgroup
HEAD_DIMS = (64, 128)
NUM_STAGES = 2

# Triton 3.6's ``hopper.tma`` does not export the TMA reduce its builder has
# (``create_async_tma_reduce``); later Triton does, as ``tma.async_atomic_add``.  It reads
# shared memory asynchronously, as the TMA store: ``tma.store_wait`` before a rewrite.
if hasattr(tma, "async_atomic_add"):
    _reduce_add = tma.async_atomic_add
else:
    @ttgl.builtin
    def _reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into ``tensor_desc``'s block at ``coord``."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ttgl.ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


@gluon.constexpr_function
def _wgmma16_layout(n, num_warps):
    """Register layout of a 16-bit-operand wgmma result [rows, n] (K step 16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _query_order(t, BN: gl.constexpr, BM: gl.constexpr):
    """A [keys, queries] tile whose columns are in the P-operand order of the Q and dO rows
    (``attention_fwd._key_order``) with its columns in query order: a relabelling."""
    return t.reshape([BN, BM // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([BN, BM])


@gluon.jit
def _dq_product(c, dq_desc, ds_smem, ke16, dq_smem, ds_ready, ds_free, b, H, kv_head, GROUP, j_lo, n_q,
                WG: gl.constexpr, BM: gl.constexpr):
    """Step c's dQ partial (this warpgroup's half of the columns, over the program's 128
    keys) from both warpgroups' dS in ``ds_smem``, rounded to bf16 and reduce-added into
    dQ itself (the wait covers every product in flight)."""
    D: gl.constexpr = 2 * ke16.shape[2]
    buf = c % 2
    mbarrier.wait(ds_ready.index(buf), (c // 2) & 1)
    dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), ke16.index(WG),
                       gl.zeros([BM, D // 2], gl.float32, _wgmma16_layout(D // 2, gl.num_warps())), use_acc=False,
                       is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    # Two staging buffers a warpgroup: the reduce of step c - 2 has read this one, step
    # c - 1's may still run (the float32 version had one and waited for the last reduce;
    # an 8 KB reduce is ~0.25 us of an SM's share of the 3.85 TB/s measured in L2).  The
    # issuing thread waits; the arrive's partition barrier makes every thread wait with it.
    tma.store_wait(1)
    mbarrier.arrive(ds_free.index(buf))
    staged = dq_smem.index(2 * WG + buf)
    staged.reshape([BM, D // 2]).store(dq.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()
    _reduce_add(dq_desc, [b, kv_head * GROUP + c // n_q, (j_lo + c % n_q) * BM, WG * (D // 2)], staged)


@gluon.jit
def _consumer(args, WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr):
    """Consumer WG, of the program's keys WG·BN .. WG·BN + BN - 1.  Step c's dQ product is
    issued in step c + 1, after dK's: the other warpgroup's half of dS(c) is ready by then
    unless it runs a step behind, so the two warpgroups need not keep in step (issued in
    step c, it held them in step; on the H100 the two orders measured within 1 %,
    docs/perf-notes/2026-12.md, "The one-kernel FP8 backward, first versions")."""
    dos_ptr, vs_ptr, kes_ptr, dk_ptr, dv_ptr, dq_desc, smem, bars, out_strides, ks, b, kv_head, H, GROUP, k0, \
        j_lo, n_q, NQ, NK = args
    k_smem, v_smem, ke16, q_bufs, do_bufs, dot_bufs, q16_bufs, row_bufs, ds_smem, dq_smem = smem
    kv_bar, q_ready, t_ready, stage_free, ds_ready, ds_free = bars
    D: gl.constexpr = k_smem.shape[3]
    nw: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _wgmma_layout(BM, nw)
    o_layout: gl.constexpr = _wgmma_layout(D, nw)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    keys = k0 + WG * BN + gl.arange(0, BN, gl.SliceLayout(1, s_layout))
    last_key = k0 + WG * BN + BN - 1
    v_scale = gl.load(vs_ptr + b * (H // GROUP) + kv_head)
    ke_scale = gl.load(kes_ptr)  # the block's (times the softmax scale): dQ's dS factor
    KEYS: gl.constexpr = k_smem.shape[2]
    k_op = k_smem.reshape([KEYS, D]).slice(WG * BN, BN)
    v_op = v_smem.reshape([KEYS, D]).slice(WG * BN, BN)
    # dK in units of ke_scale, in Q16's column parts (``_q16_columns``: one at D = 64, two at 128)
    QW: gl.constexpr = q16_bufs.shape[-1]
    PARTS: gl.constexpr = D // QW
    dk_lo = gl.zeros([BN, QW], gl.float32, _wgmma16_layout(QW, nw))
    dk_hi = gl.zeros_like(dk_lo)  # PARTS == 2 only
    dv = gl.zeros([BN, D], gl.float32, o_layout)  # in units of the current head's dO scale
    n_steps = GROUP * n_q
    do_scale = gl.load(dos_ptr + b * H + kv_head * GROUP)
    # Also where no query tile sees these keys (causal, n_steps = 0): the program must not
    # exit while the producer's loads still write its shared memory.
    mbarrier.wait(kv_bar, 0)
    for c in range(n_steps):
        stage = c % STAGES
        phase = (c // STAGES) & 1
        h = kv_head * GROUP + c // n_q  # step c: query tile j_lo + c % n_q of the group's head c // n_q
        start_m = (j_lo + c % n_q) * BM
        mbarrier.wait(q_ready.index(stage), phase)
        s, dp = _issue_s_dp(k_op, q_bufs.index(stage).reshape([BM, D]), v_op,
                            do_bufs.index(stage).reshape([BM, D]), BN, BM, s_layout)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        head_scale = gl.load(dos_ptr + b * H + h)
        if c % n_q == 0:  # a new head of the group: dV into its dO scale's units
            dv = dv * (do_scale / head_scale)
        do_scale = head_scale
        mbarrier.wait(t_ready.index(stage), phase)  # dOᵀ, Q16 and the row vectors
        vecs = (row_bufs[0].index(stage), row_bufs[1].index(stage), row_bufs[2].index(stage))
        whole = (start_m + BM <= NQ) & (last_key < NK)
        if CAUSAL:
            whole = whole & (last_key <= start_m)
        if whole:
            p8 = _p_tile(start_m, s, keys, vecs, NQ, NK, ks, 0.0, BM, CAUSAL, False, False)
        else:
            p8 = _p_tile(start_m, s, keys, vecs, NQ, NK, ks, 0.0, BM, CAUSAL, True, False)
        dot = dot_bufs.index(stage).reshape([D, BM])
        dv = warpgroup_mma(_p_operand(p8, a_layout, BN, BM), dot.permute((1, 0)), dv, is_async=True)
        delta = vecs[2].load(gl.SliceLayout(0, s_layout))
        ds = p8.to(gl.float32) * (dp * (do_scale * v_scale) - delta[None, :])

        # dS16: this warpgroup's keys of bf16 dS, queries in order, for dK now and dQ in step c + 1.
        buf = c % 2
        mbarrier.wait(ds_free.index(buf), ((c // 2) & 1) ^ 1)  # a fresh barrier counts as released
        ds_keys = ds_smem.index(buf).slice(WG * BN, BN)
        ds_keys.store(_query_order(ds * ke_scale, BN, BM).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(buf))
        dk_lo = warpgroup_mma(ds_keys, q16_bufs.index(PARTS * stage).reshape([BM, QW]), dk_lo, is_async=True)
        if PARTS == 2:
            dk_hi = warpgroup_mma(ds_keys, q16_bufs.index(2 * stage + 1).reshape([BM, QW]), dk_hi, is_async=True)
        if c > 0:
            _dq_product(c - 1, dq_desc, ds_smem, ke16, dq_smem, ds_ready, ds_free, b, H, kv_head, GROUP, j_lo, n_q,
                        WG, BM)
        dv, dk_lo, dk_hi = warpgroup_mma_wait(0, deps=(dv, dk_lo, dk_hi))
        # The whole stage released at once: each arrive costs two partition barriers
        # (before, so every thread is done; after, as shared memory was written), and
        # Q and dO wait a step longer for nothing (the producer runs a step ahead).
        mbarrier.arrive(stage_free.index(stage))
    if n_steps > 0:
        _dq_product(n_steps - 1, dq_desc, ds_smem, ke16, dq_smem, ds_ready, ds_free, b, H, kv_head, GROUP, j_lo, n_q,
                    WG, BM)
    tma.store_wait(0)
    row0 = k0 + WG * BN
    to_dk = gl.div_rn(1.0, ke_scale)  # as the reference: an IEEE reciprocal, then products
    _store_rows(dk_ptr, dk_lo * to_dk, row0, 0, b, kv_head, NK, out_strides)
    if PARTS == 2:
        _store_rows(dk_ptr, dk_hi * to_dk, row0, QW, b, kv_head, NK, out_strides)
    _store_rows(dv_ptr, dv * do_scale, row0, 0, b, kv_head, NK, out_strides)


@gluon.jit
def _producer(args, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    k_desc, v_desc, ke_desc, q_desc, do_desc, dot_desc, q16_desc, row_desc, smem, bars, b, kv_head, H, GROUP, k0, \
        j_lo, n_q, NK, NQ_PAD = args
    k_smem, v_smem, ke16, q_bufs, do_bufs, dot_bufs, q16_bufs, row_bufs, ds_smem, dq_smem = smem
    kv_bar, q_ready, t_ready, stage_free, ds_ready, ds_free = bars
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes
                    + 2 * ke_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, kv_head, k0 + w * BN, 0], kv_bar, k_smem.slice(w * BN, BN, dim=2))
        tma.async_copy_global_to_shared(v_desc, [b, kv_head, k0 + w * BN, 0], kv_bar, v_smem.slice(w * BN, BN, dim=2))
        # K's INT8 codes as bf16, [128 keys, one half of the columns] a buffer (rows flat over
        # the heads: keys past NK read the next head's, where dS is 0)
        tma.async_copy_global_to_shared(ke_desc, [(b * (H // GROUP) + kv_head) * NK + k0, w * ke16.shape[2]], kv_bar,
                                        ke16.index(w))
    for c in range(GROUP * n_q):
        h = kv_head * GROUP + c // n_q
        start_m = (j_lo + c % n_q) * BM
        s = c % STAGES
        phase = (c // STAGES) & 1
        mbarrier.wait(stage_free.index(s), phase ^ 1)  # a fresh barrier counts as released
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        chunk = ((b * H + h) * NQ_PAD + start_m) // 16  # _padded_rows
        tma.async_copy_global_to_shared(q_desc, [chunk, 0, 0, 0, 0], q_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [chunk, 0, 0, 0, 0], q_ready.index(s), do_bufs.index(s))
        QW: gl.constexpr = q16_desc.block_type.shape[3]
        PARTS: gl.constexpr = dot_desc.block_type.shape[1] // QW
        mbarrier.expect(t_ready.index(s), dot_desc.block_type.nbytes + PARTS * q16_desc.block_type.nbytes
                        + 3 * row_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(dot_desc, [b * H + h, 0, start_m], t_ready.index(s), dot_bufs.index(s))
        for part in gl.static_range(PARTS):  # rows past NQ read as zeros (dS is 0 there too)
            tma.async_copy_global_to_shared(q16_desc, [b, h, start_m, part * QW], t_ready.index(s),
                                            q16_bufs.index(PARTS * s + part))
        for i in gl.static_range(3):
            tma.async_copy_global_to_shared(row_desc, [((b * H + h) * 3 + i) * NQ_PAD + start_m], t_ready.index(s),
                                            row_bufs[i].index(s))


@gluon.jit
def _pair(STAGES: gl.constexpr, count: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bar.index(i), count=count)
    return bar


@gluon.jit
def _barriers(STAGES: gl.constexpr):
    """(kv_bar, q_ready, t_ready, stage_free, ds_ready, ds_free): the load ring's (a stage's
    Q and dO, then its dOᵀ, Q16 and row vectors; both consumers free it), and the two dS
    buffers' (both consumers arrive at each)."""
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    return once, _pair(STAGES, 1), _pair(STAGES, 1), _pair(STAGES, 2), _pair(2, 2), _pair(2, 2)


@gluon.jit
def _fused_ws(k_desc, v_desc, ke_desc, q_desc, do_desc, dot_desc, q16_desc, row_desc, dq_desc, ks_ptr, vs_ptr,
              dos_ptr, kes_ptr, dk_ptr, dv_ptr, stride_ob, stride_oh, stride_on, stride_od, stride_ksh, H, HKV, NQ,
              NK, NQ_PAD, STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
              PRODUCER_REGS: gl.constexpr):
    BN: gl.constexpr = k_desc.block_type.shape[2]  # BN_WG
    BM: gl.constexpr = 16 * q_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[3]
    # Causal: the first keys see the most query tiles; launch them first (they are pid 0).
    k0 = gl.program_id(0) * 2 * BN
    b = gl.program_id(1) // HKV
    kv_head = gl.program_id(1) % HKV
    GROUP = H // HKV
    j_lo = k0 // BM if CAUSAL else 0  # query tiles wholly before the first key see none of it
    n_q = gl.maximum(gl.cdiv(NQ, BM) - j_lo, 0)
    block = kv_head * stride_ksh + gl.program_id(0)  # [B, Hkv, blocks] scales, batch b's
    ks = gl.load(ks_ptr + b * (HKV * stride_ksh) + block)

    kv_shape: gl.constexpr = [1, 1, 2 * BN, D]
    k_smem = gl.allocate_shared_memory(k_desc.dtype, kv_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, kv_shape, v_desc.layout)
    ke16 = gl.allocate_shared_memory(gl.bfloat16, [2, 2 * BN, D // 2],
                                     gl.NVMMASharedLayout.get_default_for([2 * BN, D // 2], gl.bfloat16))
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    dot_bufs = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape, dot_desc.layout)
    q16_bufs = gl.allocate_shared_memory(q16_desc.dtype, [D // q16_desc.block_type.shape[3] * STAGES]
                                         + q16_desc.block_type.shape, q16_desc.layout)  # its column parts a stage
    row_bufs = (gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_desc.layout),
                gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_desc.layout),
                gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_desc.layout))
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 2 * BN, BM],
                                        gl.NVMMASharedLayout.get_default_for([2 * BN, BM], gl.bfloat16))
    dq_smem = gl.allocate_shared_memory(gl.bfloat16, [4] + dq_desc.block_type.shape, dq_desc.layout)
    bars = _barriers(STAGES)

    smem = (k_smem, v_smem, ke16, q_bufs, do_bufs, dot_bufs, q16_bufs, row_bufs, ds_smem, dq_smem)
    out_strides = (stride_ob, stride_oh, stride_on, stride_od)  # dK's and dV's
    kes = kes_ptr + b * (HKV * stride_ksh) + block
    args = (dos_ptr, vs_ptr, kes, dk_ptr, dv_ptr, dq_desc, smem, bars, out_strides, ks, b, kv_head, H, GROUP, k0,
            j_lo, n_q, NQ, NK)
    loads = (k_desc, v_desc, ke_desc, q_desc, do_desc, dot_desc, q16_desc, row_desc, smem, bars, b, kv_head, H,
             GROUP, k0, j_lo, n_q, NK, NQ_PAD)
    gl.warp_specialize([(_consumer, (args, 0, BM, BN, STAGES, CAUSAL)),
                        (_consumer, (args, 1, BM, BN, STAGES, CAUSAL)),
                        (_producer, (loads, BM, BN, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _q16_columns(d: int) -> int:
    """Columns of a bf16 Q box for dK's product: rows of at most 128 bytes (the widest
    swizzle a TMA box takes), so D = 128 comes in two parts and D = 64 in one."""
    return min(d, 64)


_CONSTEXPRS = dict(STAGES=NUM_STAGES, **_REGS)
_LAUNCH = dict(num_warps=4, maxnreg=168)


def covers(q, k, v_t, bias, causal, p_mode, diagonal, window, q_documents, grad_dtype) -> bool:
    """The calls this kernel is for, from what a traced graph knows (structure, head dims,
    P mode, sizes, the gradients' dtype): where it holds, the backward graph hands the op
    the one-kernel operands (``kernels.fused_backward_applies``), and ``supports`` checks
    the rest (layouts, alignment), which the op's own tensors meet."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    return (p_mode == "direct" and bias is None and q_documents is None and not (causal and (diagonal or window))
            and d in HEAD_DIMS and tuple(v_t.shape[-2:]) == (d, nk) and h % hkv == 0
            and grad_dtype == torch.bfloat16  # dQ is summed in place by bf16 TMA reduce-adds
            and b * hkv < 65536  # the grid's second dimension
            and b * h * 3 * (nq + 128) < 2**31  # the row vectors' 32-bit TMA coordinates
            and b * hkv * nk < 2**31 and hkv * nk * d < 2**31)  # dK/dV's 32-bit offsets within a batch


def supports(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, bias, row_ref,
             causal, p_mode, dq, dk, dv, diagonal, window, q_documents) -> bool:
    """Whether this kernel can compute the call (module docstring); arguments as
    ``fused_backward``, then the call's structure.  ``ke`` must be K's INT8 codes (``qe``
    is not read)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    return (covers(q, k, v_t, bias, causal, p_mode, diagonal, window, q_documents, dq.dtype)
            and ke.shape == k.shape and nq > 0 and nk > 0
            and ke_scale.shape == k_scale.shape and tuple(dq.shape) == (b, h, nq, d)  # read alike / by dQ's shape
            and q.dtype == k.dtype == ke.dtype == torch.int8 and do.dtype == v_t.dtype == F.E4M3
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (k, ke))
            and all(t.shape == (b, h, nq) for t in (q_scale, row_ref, delta))
            and dk.stride() == dv.stride() and all(st >= 0 for st in dk.stride())
            # dQ's TMA reduce-adds: rows 16-byte aligned, unit last stride
            and dq.stride(-1) == 1 and dq.data_ptr() % 16 == 0 and all(st * 2 % 16 == 0 for st in dq.stride()[:-1])
            # dK/dV offsets within a batch are 32-bit (the batch's is 64)
            and sum((n - 1) * st for n, st in zip(dk.shape[1:], dk.stride()[1:])) < 2**31)


def fused_backward(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, row_ref,
                   causal, dq, dk, dv):
    """dQ, dK, dV into ``dq`` [B, H, Nq, D] and ``dk``, ``dv`` [B, Hkv, Nk, D] (one stride
    set for those two) with ``reference.fused_attention_backward``'s numerics, for the calls
    ``supports`` accepts; arguments as ``reference.attention_backward``'s.  Its own
    preparation: token-major dOᵀ and row-major V (one transposing launch), Q's values and
    K's codes as bf16; dQ zeroed, for the kernel's bf16 reduce-adds.  ``ke`` is K's INT8
    codes and ``ke_scale`` their scales times the softmax scale; ``qe`` is not read."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    do_scale, delta, q_scale, k_scale, v_scale, ke_scale, row_ref = (
        t.float().contiguous() for t in (do_scale, delta, q_scale, k_scale, v_scale, ke_scale, row_ref))
    do_t = _token_major_empty(do)
    v = v_t.new_empty(b, hkv, nk, d)
    _transpose_all([(do, do_t), (v_t, v)])
    # formats.dequantize_q, rounded to bf16 in the same pass
    q16 = torch.mul(q, q_scale[..., None], out=torch.empty(q.shape, dtype=torch.bfloat16, device=q.device))
    bm = F.ds_block_dk(d)[0]  # queries a step, as the dK/dV kernel's
    nq_pad = triton.cdiv(nq, bm) * bm
    kv_block = [1, 1, BN_WG, d]
    k_desc = TensorDescriptor.from_tensor(k, kv_block, _layout(kv_block, gl.int8))
    v_desc = TensorDescriptor.from_tensor(v, kv_block, _layout(kv_block, gl.float8e4nv))
    ke_block = [BLOCK_N, d // 2]
    ke16 = ke.to(torch.bfloat16).view(b * hkv * nk, d)  # exact: INT8 codes are bf16 values
    ke_desc = TensorDescriptor.from_tensor(ke16, ke_block, _layout(ke_block, gl.bfloat16))
    q_desc = _permuted_rows(_padded_rows(q, bm), bm, gl.int8)
    do_desc = _permuted_rows(_padded_rows(do, bm), bm, gl.float8e4nv)
    row_desc, _ = _row_vectors(q_scale, row_ref, delta, bm)
    dq.zero_()  # the kernel adds each 128-key block's bf16 partial into it (TMA reduce-add)
    dq_block = [1, 1, bm, d // 2]
    dq_desc = TensorDescriptor(dq, list(dq.shape), list(dq.stride()), dq_block, _layout(dq_block, gl.bfloat16))
    blocks = triton.cdiv(nk, BLOCK_N)
    q16_block = [1, 1, bm, _q16_columns(d)]
    q16_desc = TensorDescriptor.from_tensor(q16, q16_block, _layout(q16_block, gl.bfloat16))
    _fused_ws[(blocks, b * hkv)](
        k_desc, v_desc, ke_desc, q_desc, do_desc, _token_major_desc(do_t, bm, gl.float8e4nv),
        q16_desc, row_desc, dq_desc, k_scale, v_scale, do_scale, ke_scale, dk, dv, *dk.stride(), k_scale.stride(1),
        h, hkv, nq, nk, nq_pad, CAUSAL=bool(causal), **_CONSTEXPRS, **_LAUNCH)


def compile_for_sm90(d: int, causal: bool):
    """Compile without a GPU (Triton's bundled ptxas), for inspection: the compiled kernel."""
    assert d in HEAD_DIMS
    bm = F.ds_block_dk(d)[0]
    sig = {"k_desc": _tensor_desc("i8", [1, 1, BN_WG, d], gl.int8),
           "v_desc": _tensor_desc("fp8e4nv", [1, 1, BN_WG, d], gl.float8e4nv),
           "ke_desc": _tensor_desc("bf16", [BLOCK_N, d // 2], gl.bfloat16),
           "q_desc": _tensor_desc("i8", [bm // 16, 2, 4, 2, d], gl.int8),
           "do_desc": _tensor_desc("fp8e4nv", [bm // 16, 2, 4, 2, d], gl.float8e4nv),
           "dot_desc": _tensor_desc("fp8e4nv", [1, d, bm], gl.float8e4nv),
           "q16_desc": _tensor_desc("bf16", [1, 1, bm, _q16_columns(d)], gl.bfloat16),
           "row_desc": _tensor_desc("fp32", [bm], gl.float32),
           "dq_desc": _tensor_desc("bf16", [1, 1, bm, d // 2], gl.bfloat16),
           "dk_ptr": "*bf16", "dv_ptr": "*bf16"}
    for name in ("ks_ptr", "vs_ptr", "dos_ptr", "kes_ptr"):
        sig[name] = "*fp32"
    return _compile_sm90(_fused_ws, sig, dict(_CONSTEXPRS, CAUSAL=causal), _LAUNCH)
