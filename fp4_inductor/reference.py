"""Reference attention: what the kernels compute, emulated in torch.

The forward walks key tiles of ``formats.KEY_TILE`` in order with an integer running
maximum, exactly like the kernels, so P codes match bit for bit and outputs differ only
by float32 summation order.  The backward rebuilds P against the forward's integer row
reference (see ``formats.backward_row_factor``).  On CPU (and wherever no kernel exists) the custom ops run
these functions.
"""

from __future__ import annotations

import math

import torch

from . import documents as D
from . import formats as F


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads for GQA (reference only; kernels index the shared head)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h = x.shape[:2]
    return x.unflatten(1, (kv_heads, h // kv_heads)).sum(dim=2) if h != kv_heads else x


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # a * b is exact in float64, so this rounds once, as a fused multiply-add does.
    return (a.double() * b.double() + c.double()).float()


def log2_scores(
    q8: torch.Tensor,
    k8: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    keys: slice,
    queries: slice = slice(None),
    diagonal: int = 0,
    window: int = 0,
    documents: tuple | None = None,
) -> torch.Tensor:
    """``x = (q8 . k8) * (q_scale * log2e * k_scale) + bias`` for one key range (and
    query range), -inf where the causal structure (``formats.visible``) or the documents
    (``(q_documents, k_documents)``, ``documents.same_document``) hide a key.
    float64: without a bias the exact product, which Direct-P's codes round once (the
    kernels fold the product into their FFMA); its other uses round it to float32 first
    (``x.float()``, the kernels' ``mul.rn``).  With a bias, the float32 FMA."""
    nq, nk = q8.shape[-2], k8.shape[-2]
    # INT8 products summed exactly: float64 holds every partial sum (|acc| < 2**24 for
    # D <= 1024, so the float32 value is exact too), and unlike int64 it runs on CUDA.
    k = _heads(k8, q8.shape[1])[..., keys, :].double()
    acc = (q8[..., queries, :].double() @ k.transpose(-1, -2)).float()
    row = q_scale[..., queries] * F.LOG2E
    col = _heads(F.expand_block_scale(k_scale, nk)[..., keys], q8.shape[1])
    t = row[..., :, None] * col[..., None, :]
    if bias is None:
        x = acc.double() * t.double()  # exact: a 22-bit integer times a float32
    else:
        b = bias.expand(*q8.shape[:2], nq, nk)[..., queries, keys]
        x = _fma(acc, t, b).double()
    rows = torch.arange(nq, device=x.device)[queries][:, None]
    cols = torch.arange(nk, device=x.device)[keys][None, :]
    keep = F.visible(rows, cols, causal, diagonal, window)
    if documents is not None:
        same = D.same_document(*documents, queries, keys)
        keep = same if keep is None else keep & same
    return x if keep is None else x.masked_fill(~keep, float("-inf"))


def _probability(x: torch.Tensor, m: torch.Tensor, p_mode: str) -> torch.Tensor:
    pad = (-x.shape[-1]) % F.FP4_BLOCK if p_mode == "fp4" else 0
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    p = F.probability_operand(x, m, p_mode)
    return p[..., : p.shape[-1] - pad] if pad else p


def attention_forward(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8t: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    p_mode: str,
    out_dtype: torch.dtype,
    diagonal: int = 0,
    window: int = 0,
    q_documents: torch.Tensor | None = None,
    k_documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns O ``[B, H, Nq, Dv]`` in ``out_dtype``, the natural-log LSE ``[B, H, Nq]`` and
    the integer row reference the codes were last built against (the ceiling of each
    row's largest log2 score, float32 ``[B, H, Nq]``), which backward rebuilds P from.
    A row with no visible key (``formats.EMPTY_ROW_LOG2``) gets O = 0, LSE = -inf and
    reference 0.  With documents, each block of queries walks only the key tiles of its
    documents (``_key_tiles``); a skipped tile holds no visible key, so it would have
    changed nothing."""
    b, h, nq, _ = q8.shape
    nk, dv = k8.shape[-2], v8t.shape[-2]
    documents = None if q_documents is None else (q_documents, k_documents)
    v = _heads(v8t.transpose(-1, -2), h).float()
    m = torch.full((b, h, nq, 1), float("-inf"), device=q8.device)
    l = torch.zeros((b, h, nq, 1), device=q8.device)
    acc = torch.zeros((b, h, nq, dv), device=q8.device)
    for rows, tiles in _key_tiles(nq, nk, documents, F.KEY_TILE if documents is not None else max(nq, 1)):
        for start in tiles:
            keys = slice(start, min(start + F.KEY_TILE, nk))
            x = log2_scores(q8, k8, q_scale, k_scale, bias, causal, keys, rows, diagonal, window, documents)
            m_old = m[..., rows, :]
            m_new = torch.maximum(m_old, torch.ceil(x.float().amax(dim=-1, keepdim=True)))
            # Rows with every key so far masked keep reference -inf and contribute nothing.
            alpha = torch.where(m_new == m_old, 1.0, torch.exp2(m_old - m_new))
            # A row with no visible key yet has P = 0 whatever its reference: 0 instead of -inf
            # keeps x - m from NaN (-inf - -inf).
            p = _probability(x, torch.where(m_new == float("-inf"), 0.0, m_new), p_mode)
            l[..., rows, :] = l[..., rows, :] * alpha + p.sum(dim=-1, keepdim=True)
            acc[..., rows, :] = acc[..., rows, :] * alpha + p @ v[..., keys, :]
            m[..., rows, :] = m_new
    empty = m < F.EMPTY_ROW_LOG2
    out = torch.where(empty, 0.0, acc * (_heads(v_scale, h)[..., None, None] / l))
    lse = torch.where(empty, float("-inf"), (m + torch.log2(l) - F.p_lift(p_mode)) * F.LN2)
    m = torch.where(empty, 0.0, m)
    return out.to(out_dtype), lse.squeeze(-1), m.squeeze(-1)


def _key_tiles(nq: int, nk: int, documents, rows: int):
    """(query rows, the starts of the key tiles they walk) for each ``rows`` queries:
    every key tile, or with documents the tiles their documents' keys span in any batch
    row (``documents.key_ranges``)."""
    blocks = [slice(i, min(i + rows, nq)) for i in range(0, nq, rows)]
    if documents is None or not blocks or nk == 0:
        return [(block, range(0, nk, F.KEY_TILE)) for block in blocks]
    ranges = D.key_ranges(*documents, F.KEY_TILE, rows)
    lo, hi = ranges[..., 0].amin(dim=0).tolist(), ranges[..., 1].amax(dim=0).tolist()
    return [(block, range(lo[i], hi[i], F.KEY_TILE)) for i, block in enumerate(blocks)]


def ds_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` [..., Nq, Nk] zero-padded and cut into ``block`` = (tm, tn) blocks from
    element 0: [..., ceil(Nq / tm), ceil(Nk / tn), tm, tn]."""
    tm, tn = block
    nq, nk = x.shape[-2:]
    x = torch.nn.functional.pad(x, (0, (-nk) % tn, 0, (-nq) % tm))
    return x.unflatten(-1, (-1, tn)).unflatten(-3, (-1, tm)).transpose(-3, -2)


def quantize_ds_blocks(ds: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """dS rounded to E4M3 with one amax scale per ``block`` (``formats.DS_BLOCK_DQ`` or
    ``ds_block_dk``) from element 0, returned dequantized."""
    nq, nk = ds.shape[-2:]
    codes, scale = F.quantize_ds(ds_blocks(ds, block))
    deq = (codes * scale).transpose(-3, -2).flatten(-4, -3).flatten(-2)
    return deq[..., :nq, :nk]


def attention_backward(
    do8: torch.Tensor,
    do_scale: torch.Tensor,
    delta: torch.Tensor,
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8t: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    qe: torch.Tensor,
    qe_scale: torch.Tensor,
    ke: torch.Tensor,
    ke_scale: torch.Tensor,
    bias: torch.Tensor | None,
    row_ref: torch.Tensor,
    causal: bool,
    p_mode: str,
    out_dtype: torch.dtype,
    diagonal: int = 0,
    window: int = 0,
    q_documents: torch.Tensor | None = None,
    k_documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. the quantized operands' real values: dQ (for Q times the softmax
    scale), dK, dV.  ``do8`` is dO times ``formats.backward_row_factor`` in E5M2,
    ``delta = rowsum(dequantized do8 * O)``, and ``qe``/``ke`` are the E4M3 views of
    ``formats.backward_operands``."""
    h, hkv = q8.shape[1], k8.shape[1]
    nq, nk = q8.shape[-2], k8.shape[-2]
    documents = None if q_documents is None else (q_documents, k_documents)
    do = do8.float() * do_scale[..., None, None]
    v = _heads(v8t.transpose(-1, -2), h).float() * _heads(v_scale, h)[..., None, None]
    k = _heads(F.dequantize_blockwise(ke, ke_scale), h)
    q = F.dequantize_blockwise(qe, qe_scale)
    r = row_ref.float()
    # Row blocks holding whole dQ and dK scale blocks: memory grows with N, not N**2, and the
    # blocks stay aligned at 0 as the kernels' are; with documents each block takes the key
    # tiles of its documents alone (whole dQ scale blocks: those outside hold dS = 0).
    dk_block = F.ds_block_dk(q8.shape[-1])
    step = math.lcm(F.DS_BLOCK_DQ[0], dk_block[0])
    dq = torch.zeros(*q8.shape[:-1], ke.shape[-1], device=q8.device)
    dk = torch.zeros(*q8.shape[:2], nk, q8.shape[-1], device=q8.device)
    dv = torch.zeros(*q8.shape[:2], nk, v8t.shape[-2], device=q8.device)
    for rows, tiles in _key_tiles(nq, nk, documents, step):
        if not tiles:
            continue
        keys = slice(tiles[0], min(tiles[-1] + F.KEY_TILE, nk))
        x = log2_scores(q8, k8, q_scale, k_scale, bias, causal, keys, rows, diagonal, window, documents)
        p = _probability(x, r[..., rows, None], p_mode)
        ds = p * (do[..., rows, :] @ v[..., keys, :].transpose(-1, -2) - delta[..., rows, None])
        dq[..., rows, :] = quantize_ds_blocks(ds, F.DS_BLOCK_DQ) @ k[..., keys, :]
        dk[..., keys, :] += quantize_ds_blocks(ds, dk_block).transpose(-1, -2) @ q[..., rows, :]
        dv[..., keys, :] += p.transpose(-1, -2) @ do[..., rows, :]
    return dq.to(out_dtype), _group_sum(dk, hkv).to(out_dtype), _group_sum(dv, hkv).to(out_dtype)


def fused_attention_backward(do8, do_scale, delta, q8, k8, v8t, q_scale, k_scale, v_scale, qe, qe_scale, ke,
                             ke_scale, bias, row_ref, causal, p_mode, out_dtype):
    """``attention_backward``'s gradients with the one-kernel backward's numerics
    (``kernels/gluon/attention_bwd_fused.py``), whose ``ke``/``ke_scale`` are K's INT8 codes
    and scales (times the softmax scale; ``qe`` is not read): P, dP and dS as there; dV =
    Pᵀ·dO summed in float32; dS rounded once, to bf16 times the key block's ``ke_scale``
    (``ds16``), for both 16-bit products: dQ = Σ ds16·K8, each 128-key block's partial rounded to bf16 and
    added into a bf16 sum (the kernel's TMA reduce-adds, here in block order), and
    dK = Σ ds16ᵀ·bf16(Q) · (1 / ke_scale) summed in float32, bf16(Q) from the forward's INT8
    codes (``formats.dequantize_q``), not Qe's E4M3 ones.  SDPA's causal structure or none,
    no documents."""
    b, h, nq, d = q8.shape
    hkv, nk = k8.shape[1], k8.shape[2]
    group = h // hkv
    do = do8.float() * do_scale[..., None, None]
    v = _heads(v8t.transpose(-1, -2), h).float() * _heads(v_scale, h)[..., None, None]
    ds16_scale = _heads(F.expand_block_scale(ke_scale, nk), h)[..., None, :]  # [B, H, 1, Nk]
    ke_codes = _heads(ke, h).float()
    q16 = F.dequantize_q(q8, q_scale).to(torch.bfloat16).float()
    r = row_ref.float()
    bm = F.ds_block_dk(d)[0]
    dq = torch.zeros(b, h, nq, ke.shape[-1], device=q8.device)
    dv = torch.zeros(b, hkv, nk, v8t.shape[-2], device=q8.device)
    dk = torch.zeros(b, hkv, nk, d, device=q8.device)  # in units of ke_scale
    for g in range(group):  # query head kv_head * group + g, for every kv head at once
        heads = slice(g, None, group)
        for start in range(0, nq, bm):
            rows = slice(start, min(start + bm, nq))
            x = log2_scores(q8[:, heads], k8, q_scale[:, heads], k_scale, bias if bias is None else
                            bias.expand(b, h, nq, nk)[:, heads], causal, slice(0, nk), rows)
            p = _probability(x, r[:, heads, rows, None], p_mode)
            dsv = p * (do[:, heads, rows] @ v[:, heads].transpose(-1, -2) - delta[:, heads, rows, None])
            dv += p.transpose(-1, -2) @ do[:, heads, rows]
            ds16 = (dsv * ds16_scale[:, heads]).to(torch.bfloat16).float()
            acc = torch.zeros_like(dq[:, heads, rows], dtype=torch.bfloat16)
            for k0 in range(0, nk, F.KEY_TILE):  # the programs' partials, added in bf16
                block = slice(k0, k0 + F.KEY_TILE)
                part = (ds16[..., block] @ ke_codes[:, heads, block]).to(torch.bfloat16)
                acc = (acc.float() + part.float()).to(torch.bfloat16)
            dq[:, heads, rows] = acc.float()
            dk += ds16.transpose(-1, -2) @ q16[:, heads, rows]
    dk = dk * (1.0 / F.expand_block_scale(ke_scale, nk))[..., None]
    return dq.to(out_dtype), dk.to(out_dtype), dv.to(out_dtype)


def bf16_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    diagonal: int = 0,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the hybrid path's BF16 backward kernels (``kernels.bf16_backward``) compute
    from the forward's O and natural-log LSE: P = exp(scale Q K^T + bias - LSE) in float32
    from the inputs' values, rounded to their dtype as an operand of dV = P^T dO, and
    dS = P (dO V^T - rowsum(dO O)) rounded likewise for dQ = scale dS K and
    dK = scale dS^T Q; float32 accumulation.  ``bias``: float32 log2 units or None.  Rows
    with no visible key (LSE -inf) get zero gradients."""
    h, hkv = q.shape[1], k.shape[1]
    nq, nk = q.shape[-2], k.shape[-2]
    dtype = q.dtype
    kf, vf = (_heads(t, h).float() for t in (k, v))
    qf, do = q.float(), dout.float()
    delta = (do * out.float()).sum(-1, keepdim=True)
    lse = torch.where(lse == float("-inf"), float("inf"), lse)[..., None]  # P = 0 on empty rows
    dq, dk, dv = [], 0.0, 0.0
    for start in range(0, nq, 1024):  # row blocks: memory grows with N, not N**2
        rows = slice(start, min(start + 1024, nq))
        s = (qf[..., rows, :] @ kf.transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias.expand(*q.shape[:2], nq, nk)[..., rows, :] * F.LN2
        keep = F.visible(torch.arange(nq)[rows, None], torch.arange(nk)[None, :], causal, diagonal, window)
        if keep is not None:
            s = s.masked_fill(~keep.to(s.device), float("-inf"))
        p = torch.exp(s - lse[..., rows, :])
        ds = p * (do[..., rows, :] @ vf.transpose(-1, -2) - delta[..., rows, :])
        p, ds = p.to(dtype).float(), ds.to(dtype).float()
        dv = dv + p.transpose(-1, -2) @ do[..., rows, :]
        dk = dk + ds.transpose(-1, -2) @ qf[..., rows, :]
        dq.append(ds @ kf)
    dq = torch.cat(dq, dim=-2) * scale
    return dq.to(dtype), (_group_sum(dk, hkv) * scale).to(dtype), _group_sum(dv, hkv).to(dtype)
