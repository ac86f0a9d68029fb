"""The backward's operands, prepared once a call for the kernels that compute dQ and dK/dV
(the Triton ones, ``attention_bwd``; the Gluon ones, ``kernels/gluon/attention_bwd_*``):
checks, float32 scales and rows, token-major copies, the key-row bias.

8-bit wgmma wants both shared-memory operands K-major (contiguous along the contracted
dimension), so the products contracted over tokens get token-contiguous copies: dO^T and
Qe^T ``[.., D, Nq]``, Ke^T ``[.., D, Nk]``, and V ``[.., Nk, D]`` (the saved V is stored
``[.., D, Nk]`` for the forward's P.V).  Each copy (a tiled transpose; the four share one
launch) moves N * D bytes, small against the N^2 * D products.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from ... import formats as F
from . import key_bias


@dataclasses.dataclass(frozen=True)
class BackwardOperands:
    """What the dQ and dK/dV launches read, as ``reference.attention_backward`` names them:
    scales and rows float32; ``do_t``, ``qe_t``, ``ke_t`` token-major, ``v`` row-major
    [B, Hkv, Nk, Dv]; ``bias`` the float32 bias expanded to [B, H, Nq, Nk] (or None),
    ``key_rows`` its ``key_bias.KeyRows`` when it is a key-row bias (one per call, shared by
    the call's kernels), ``skip`` the Triton kernels' ``key_bias.skip_ranges`` of it;
    ``emulate`` the Triton kernels' float32 emulation of their 8-bit products (under the
    interpreter, or asked: no Gluon kernel then)."""

    do: torch.Tensor
    do_t: torch.Tensor
    do_scale: torch.Tensor
    delta: torch.Tensor
    q: torch.Tensor
    q_scale: torch.Tensor
    qe_t: torch.Tensor
    qe_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    ke_t: torch.Tensor
    ke_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    row_ref: torch.Tensor
    bias: torch.Tensor | None
    key_rows: key_bias.KeyRows | None
    skip: tuple | None
    causal: bool
    p_mode: str
    diagonal: int
    window: int
    q_documents: torch.Tensor | None
    k_documents: torch.Tensor | None
    emulate: bool


def prepare(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, bias, row_ref,
            causal, p_mode, dk, dv, diagonal=0, window=0, q_documents=None, k_documents=None,
            emulate=None) -> BackwardOperands | None:
    """The call's ``BackwardOperands`` (arguments as ``reference.attention_backward``), or
    None for a call with no query or no key, whose ``dk`` and ``dv`` it zeroes.  It takes
    the one-kernel backward's operands too (``ops.attention_bwd``: the forward's INT8 codes
    in place of ``qe``/``ke``, from which it derives the copies, and dO in E4M3).
    ``emulate`` overrides the interpreter's choice (tests)."""
    b, h, nq, d = q.shape
    hkv, nk, dv_dim = k.shape[1], k.shape[2], v_t.shape[-2]
    if not (F.supported_head_dim(d) and F.supported_head_dim(dv_dim)):
        raise ValueError(f"head dims {d}/{dv_dim} not supported (multiples of {F.HEAD_DIM_STEP} from "
                         f"{F.MIN_HEAD_DIM} to {F.MAX_HEAD_DIM})")
    if h % hkv:
        raise ValueError(f"{h} query heads not a multiple of {hkv} kv heads")
    if ke.dtype == torch.int8:  # the one-kernel backward's operands, which its launch refused: these
        # kernels read E4M3 copies of Q and K (its E4M3 dO as it is: the Triton kernels' products take
        # either 8-bit float, the Gluon two kernels E5M2 only)
        qe, qe_scale, ke, ke_scale = F.backward_operands_in_place_of_codes(q, q_scale, k, k_scale, ke_scale)
    if q.dtype != torch.int8 or k.dtype != torch.int8 or v_t.dtype != F.E4M3 or do.dtype not in (F.E5M2, F.E4M3) \
            or qe.dtype != F.E4M3 or ke.dtype != F.E4M3:
        raise TypeError("expected int8 q/k, float8_e4m3fn v_t/qe/ke and float8_e5m2 (or e4m3fn) do, got "
                        f"{q.dtype}, {k.dtype}, {v_t.dtype}/{qe.dtype}/{ke.dtype}, {do.dtype}")
    if nq == 0 or nk == 0:
        if nk == 0 and nq:
            raise ValueError("attention over zero keys")
        dk.zero_()
        dv.zero_()
        return None
    do_scale, delta, q_scale, k_scale, v_scale, qe_scale, ke_scale, row_ref = (
        t.float() for t in (do_scale, delta, q_scale, k_scale, v_scale, qe_scale, ke_scale, row_ref))
    do_t, qe_t, ke_t = (_token_major_empty(t) for t in (do, qe, ke))
    v = v_t.new_empty(b, hkv, nk, dv_dim)
    _transpose_all([(do, do_t), (qe, qe_t), (ke, ke_t), (v_t, v)])
    key_rows = None
    if bias is not None:
        bias = bias.float().expand(b, h, nq, nk)
        key_rows = key_bias.KeyRows.of(bias, b, h, nq, nk)
    return BackwardOperands(
        do, do_t, do_scale, delta, q, q_scale, qe_t, qe_scale, k, k_scale, ke_t, ke_scale, v, v_scale, row_ref,
        bias, key_rows, key_bias.skip_ranges(key_rows, F.KEY_TILE), bool(causal), p_mode, diagonal, window,
        q_documents, k_documents, _interpreted() if emulate is None else emulate)


def _interpreted() -> bool:
    """Under TRITON_INTERPRET=1 (CPU) the Triton kernels' float8 casts run as float32
    arithmetic and the products as float32 matmuls of exact E4M3/E5M2 values (the
    interpreter's own float8 casts do not round to nearest even)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _transpose_tile(x, out, B, H, R, C, stride_xb, stride_xh, stride_xr, stride_xc, stride_ob, stride_oh, stride_oc,
                    BLOCK: tl.constexpr):
    """out[b, h, c, r] = x[b, h, r, c] for this program's tile, if the copy has it: a tile
    read along C and written along R (Triton stages it through shared memory).  64-bit
    offsets: a copy is cheap either way."""
    col_tiles = tl.cdiv(C, BLOCK)
    if (tl.program_id(0) < tl.cdiv(R, BLOCK) * col_tiles) & (tl.program_id(1) < B * H):
        b, h = (tl.program_id(1) // H).to(tl.int64), (tl.program_id(1) % H).to(tl.int64)
        rows = (tl.program_id(0) // col_tiles) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        cols = (tl.program_id(0) % col_tiles) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        ok = (rows < R)[:, None] & (cols < C)[None, :]
        tile = tl.load(x + b * stride_xb + h * stride_xh + rows[:, None] * stride_xr + cols[None, :] * stride_xc,
                       mask=ok)
        tl.store(out + b * stride_ob + h * stride_oh + cols[None, :] * stride_oc + rows[:, None], tile, mask=ok)


@triton.jit
def _transpose_kernel(B,
                      x0, o0, h0, r0, c0, sxb0, sxh0, sxr0, sxc0, sob0, soh0, soc0,
                      x1, o1, h1, r1, c1, sxb1, sxh1, sxr1, sxc1, sob1, soh1, soc1,
                      x2, o2, h2, r2, c2, sxb2, sxh2, sxr2, sxc2, sob2, soh2, soc2,
                      x3, o3, h3, r3, c3, sxb3, sxh3, sxr3, sxc3, sob3, soh3, soc3,
                      BLOCK: tl.constexpr):
    """Up to four byte transposes in one launch, the copy chosen by the grid's third axis
    (one launch instead of four: each costs tens of microseconds of host dispatch)."""
    job = tl.program_id(2)
    if job == 0:
        _transpose_tile(x0, o0, B, h0, r0, c0, sxb0, sxh0, sxr0, sxc0, sob0, soh0, soc0, BLOCK)
    elif job == 1:
        _transpose_tile(x1, o1, B, h1, r1, c1, sxb1, sxh1, sxr1, sxc1, sob1, soh1, soc1, BLOCK)
    elif job == 2:
        _transpose_tile(x2, o2, B, h2, r2, c2, sxb2, sxh2, sxr2, sxc2, sob2, soh2, soc2, BLOCK)
    else:
        _transpose_tile(x3, o3, B, h3, r3, c3, sxb3, sxh3, sxr3, sxc3, sob3, soh3, soc3, BLOCK)


def _transpose_all(pairs) -> None:
    """For each (x, out) of up to four pairs of 8-bit tensors of one batch size:
    ``out`` [B, H, C, R] (unit last stride) = ``x`` [B, H, R, C] transposed, in one launch.
    A tiled copy, where ``copy_`` of a transposed byte tensor moves a byte a thread (the
    launcher's four copies took ~0.4-0.8 ms per backward at 16k tokens and H·D = 2048 on
    the H200)."""
    assert 1 <= len(pairs) <= 4
    args, tiles, heads = [], 1, 1
    for x, out in pairs:
        b, h, r, c = x.shape
        assert out.shape == (b, h, c, r) and out.stride(-1) == 1 and x.element_size() == out.element_size() == 1
        assert b == pairs[0][0].shape[0]
        x8, out8 = x.view(torch.uint8), out.view(torch.uint8)  # bytes: no float8 semantics in a copy
        args += [x8, out8, h, r, c, *x8.stride(), *out8.stride()[:3]]
        tiles, heads = max(tiles, triton.cdiv(r, 64) * triton.cdiv(c, 64)), max(heads, b * h)
    args += args[:12] * (4 - len(pairs))  # unused slots: never read (their grid index is past len(pairs))
    # Tiles on the unbounded axis; programs past a copy's own tiles or heads do nothing.
    _transpose_kernel[(tiles, heads, len(pairs))](pairs[0][0].shape[0], *args, BLOCK=64)


def _token_major_empty(x: torch.Tensor) -> torch.Tensor:
    """An empty ``[B, H, D, N]`` view for ``x`` ``[B, H, N, D]`` transposed, whose row stride
    is N rounded up to 16 elements: rows start 16-byte aligned for any N, and every length
    shares one compiled specialisation."""
    n = x.shape[-2]
    return x.new_empty(*x.shape[:-2], x.shape[-1], (n + 15) // 16 * 16)[..., :n]
