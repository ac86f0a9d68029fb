"""The function rewritten graphs call in place of an attention site.

Q, K and V are quantized by one op (``fp4attn::quantize``), dO by plain torch code that
Inductor fuses into the backward graph.  Autograd is a ``torch.autograd.Function`` around
quantize + ``fp4attn::fwd``: the op's inputs are integer codes, which carry no gradient,
so the gradient must be attached where the high-precision inputs are still in view
(a straight-through estimator for the rounding, exact for the attention itself).
"""

from __future__ import annotations

import math

import torch

from . import documents, kernels
from . import formats as F
from . import quantized


def refuse_double_backward():
    """Under create_graph=True our backward ops (no gradient of their own) would return
    detached dQ, dK, dV and a second-order term would vanish without a word
    (``once_differentiable`` raises only when dO itself requires grad): raise instead."""
    if torch.is_grad_enabled():
        raise RuntimeError("fp4attn: low-precision attention has no second derivative (create_graph=True); "
                           "use F.scaled_dot_product_attention (policy='never') for double backward")


class _LowPrecisionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, sm_scale, causal, fmt, p_mode, diagonal, window, q_documents, k_documents):
        out, lse, row_ref, operands = quantized.quantized_forward(q, k, v, bias, sm_scale, causal, fmt, p_mode,
                                                                  diagonal, window, q_documents, k_documents)
        ctx.save_for_backward(*operands.flat(), bias, out, lse, row_ref, q_documents, k_documents)
        ctx.sm_scale, ctx.causal, ctx.p_mode, ctx.structure = sm_scale, causal, p_mode, (diagonal, window)
        # Gradients in the inputs' layout: contiguous inputs (leaves, say) get contiguous
        # gradients, so that autograd does not re-lay them out with a strided copy.
        ctx.grads_contiguous = all(t.is_contiguous() for t in (q, k, v))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        refuse_double_backward()
        *flat, bias, out, lse, row_ref, q_documents, k_documents = ctx.saved_tensors
        operands = quantized.Operands.of(*flat)
        fused = kernels.fused_backward_applies(operands.q.codes, operands.k.codes, operands.v.codes, bias, ctx.causal,
                                               ctx.p_mode, *ctx.structure, q_documents, dout.dtype)
        grad = quantized.grad_operands(dout, out, lse, row_ref, operands, ctx.p_mode, fused)
        dq, dk, dv = quantized.quantized_backward(grad, operands, bias, row_ref, ctx.sm_scale, ctx.causal,
                                                  ctx.p_mode, dout.dtype, ctx.grads_contiguous, *ctx.structure,
                                                  q_documents, k_documents)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


class _HybridAttention(torch.autograd.Function):
    """The FP8 forward with a BF16 FlashAttention-class backward (``fp4attn::bf16_bwd``):
    what is saved is what BF16 SDPA saves (Q, K, V, O, LSE; no quantized copies), and the
    backward applies the forward's exact structure to the call's own, unpadded keys."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding, sm_scale, causal, fmt, p_mode, diagonal, window):
        k_op, v_op, bias = quantized.align_keys(k, v, attn_mask, key_padding)
        out, lse = quantized.quantized_forward(q, k_op, v_op, bias, sm_scale, causal, fmt, p_mode, diagonal, window)[:2]
        if k_op is not k:  # the backward's bias without the padding keys (None without masks)
            bias = F.mask_to_log2_bias(attn_mask, key_padding)
        ctx.save_for_backward(q, *bf16_backward_frame(k, k_op, lse, p_mode), v, bias, out)
        ctx.sm_scale, ctx.causal, ctx.structure = sm_scale, causal, (diagonal, window)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        refuse_double_backward()
        q, k, lse, v, bias, out = ctx.saved_tensors
        dq, dk, dv = torch.ops.fp4attn.bf16_bwd(dout, q, k, v, out, lse, bias, ctx.sm_scale, ctx.causal,
                                                *ctx.structure)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def bf16_backward_frame(k, k_op, lse, p_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and LSE a BF16 backward recomputes P from: the forward's own frame, K less the
    mean it subtracted (``formats.k_smoothing_mean`` of ``k_op``, the K the forward
    quantized), and the forward's LSE less Direct-P's sum bias.  Recomputing from the real
    K adds the mean times dS's row sums to dQ, sums that vanish only where O is exact: with
    the FP8 forward's O, dQ was 0.10 / 0.21 rel-L2 against fp64 for keys whose mean is
    2 / 5 times their spread, and training diverged (H100, 2026-12-06); in this frame dQ
    is 0.02, dK and dV unchanged (the mean, like any vector shared by a head's keys,
    leaves P alone).  Without the bias correction the gradients were 0.09 rel-L2."""
    k_smoothed = (k.float() - F.k_smoothing_mean(k_op)).to(k.dtype)
    return k_smoothed, lse - F.p_sum_log_bias(p_mode)


# The backward a training site takes: the format's own low-precision one, or BF16 after
# the low-precision forward (``_HybridAttention``).
BACKWARDS = ("lowp", "bf16")


def default_p_mode(fmt: str) -> str:
    return "fp4" if fmt == "fp4" else "direct"


# What a query row with no visible key gets, by what the replaced code computes there:
# "zero" (SDPA with a boolean mask or -inf, FlashAttention's convention, and the op's own
# result), "nan" (softmax over -inf fills), "mean" (the mean of V: softmax over equal
# finite fills such as finfo.min, which hide the scores), or decided per row at run time
# from an additive mask: "sdpa" (zero where the row's mask is all -inf, else mean) and
# "softmax" (NaN there, else mean).
EMPTY_ROWS = ("zero", "nan", "mean", "sdpa", "softmax")


def empty_row_fill(out, empty, v, mode: str, attn_mask=None):
    """``out`` with the rows ``empty`` ([B, H, Nq], no visible key) given what ``mode``
    says; the run-time modes read an additive ``attn_mask`` (a boolean one has no fill
    values: its rows get the mean).  Rows with a visible key are untouched."""
    if mode == "zero":
        return out
    mean = v.float().mean(dim=-2, keepdim=True)
    fill = mean.repeat_interleave(out.shape[1] // v.shape[1], dim=1)  # GQA: V's head of each query head
    if mode != "mean":
        if mode != "nan" and attn_mask is not None and attn_mask.dtype != torch.bool:
            all_neg_inf = (attn_mask == -math.inf).all(-1).expand(empty.shape)[..., None]
        else:
            all_neg_inf = torch.full((), mode == "nan", device=out.device)
        fill = torch.where(all_neg_inf, 0.0 if mode == "sdpa" else math.nan, fill)
    return torch.where(empty[..., None], fill.to(out.dtype), out)


def lowp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale=None,
    is_causal: bool = False,
    *,
    fmt: str = "fp8",
    p_mode: str | None = None,
    min_keys: int | None = None,
    diagonal: int = 0,
    window: int = 0,
    key_padding: torch.Tensor | None = None,
    empty_rows: str = "zero",
    q_documents: torch.Tensor | None = None,
    k_documents: torch.Tensor | None = None,
    backward: str = "lowp",
) -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention`` (no dropout) in low precision.

    ``q``: ``[B, H, Nq, D]`` or ``[B, Nq, D]``; ``k``: same rank with ``Hkv`` dividing ``H``
    (GQA/MQA without repeating K/V); ``v``: like ``k`` with its own head dim.
    ``attn_mask``: boolean (True keeps) or additive, broadcastable to ``[B, H, Nq, Nk]``.
    ``scale``: float, SymFloat or 0-d tensor; None means ``1 / sqrt(D)``.  The causal
    structure, which the kernels apply without a mask tensor (``formats.visible``):
    ``is_causal`` (top-left, as SDPA, with ``diagonal`` 0), ``diagonal`` (key ``j``
    visible to query ``i`` iff ``j <= i + diagonal``), ``window`` (and ``j > i + diagonal
    - window``); ``key_padding``: ``[B, Nk]`` boolean, True for keys every query may see;
    ``q_documents`` ``[B, Nq]`` and ``k_documents`` ``[B, Nk]``: integer document ids, a
    query seeing only keys of its own document (``documents.py``).
    ``empty_rows``: what a query row with no visible key gets (``EMPTY_ROWS``).
    ``min_keys`` (inference only): low precision only from this many keys at run time,
    SDPA below, decided per call without a guard on the length (``fp4attn::by_length``).
    ``backward`` (``BACKWARDS``): ``"lowp"``, the format's own backward kernels, or
    ``"bf16"``, a BF16 FlashAttention-class backward from the forward's O and LSE
    (``kernels.bf16_backward``; the policy's path ``fp8+bf16bwd``).
    """
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"query and key head dims differ ({q.shape[-1]}, {k.shape[-1]}): "
                         "use F.scaled_dot_product_attention")
    if empty_rows not in EMPTY_ROWS:
        raise ValueError(f"empty_rows must be one of {EMPTY_ROWS}, got {empty_rows!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if window and not is_causal:
        raise ValueError("a window needs is_causal")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (attn_mask, scale)):
        # The mask becomes a fixed bias and the scale is folded into the operands: neither
        # would get its gradient.  (The compiler leaves such sites to SDPA.)
        raise ValueError("a mask or scale that requires grad is not supported: use F.scaled_dot_product_attention")
    documents.check(q_documents, k_documents, q.shape[0], q.shape[-2], k.shape[-2])
    if q_documents is not None:
        q_documents, k_documents = (ids.long().contiguous() for ids in (q_documents, k_documents))
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif not isinstance(scale, (int, float)):
        q, scale = F.fold_scale(q, scale), 1.0
    p_mode = p_mode or default_p_mode(fmt)
    if backward == "bf16" and p_mode not in ("direct", "exp"):
        raise ValueError(f"backward='bf16' needs fmt='fp8' (P mode direct or exp), got P mode {p_mode!r}")
    if backward == "bf16" and q_documents is not None:
        raise ValueError("backward='bf16' does not apply document masks (no BF16 backward takes them)")
    if min_keys is not None:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("min_keys (a run-time branch) is for inference: the branch has no autograd")
        out, empty = torch.ops.fp4attn.by_length(q, k, v, attn_mask, float(scale), is_causal, fmt, p_mode, min_keys,
                                                 diagonal, window, key_padding, q_documents, k_documents)
    elif backward == "bf16":
        out, lse = _HybridAttention.apply(q, k, v, attn_mask, key_padding, float(scale), is_causal, fmt, p_mode,
                                          diagonal, window)
        empty = lse == -math.inf
    else:
        k_op, v_op, bias = quantized.align_keys(k, v, attn_mask, key_padding)
        out, lse = _LowPrecisionAttention.apply(q, k_op, v_op, bias, scale, is_causal, fmt, p_mode, diagonal, window,
                                                q_documents, documents.pad_keys(k_documents, k_op.shape[-2]))
        empty = lse == -math.inf
    out = empty_row_fill(out, empty, v, empty_rows, attn_mask)
    return out.squeeze(1) if squeeze else out
