"""The host side of the low-precision path around the ops: the key alignment, quantized
operands as named bundles, the forward and backward through ``fp4attn::quantize``,
``fwd`` and ``bwd``, and ``fp4attn::by_length``, the run-time choice between that path and
SDPA (``sdpa_with_structure``, which ``tune()`` times too).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import documents, ops
from . import formats as F


# Keys a call's K and V are padded to a multiple of: the Gluon kernels read V^T's rows and
# K's 16-key chunks as TMA boxes (16-byte aligned), and the Triton kernel falls back to byte
# loads of V^T without them (a Wan2.1 480p video's 32760 tokens: 338 ms against 24 ms for
# 32768 tokens on the Gluon kernel, H200, docs/perf-notes/2026-12.md, "Models end to end, and
# a 14x slowdown at unaligned key counts").
KEY_ALIGN = 16


def align_keys(k, v, attn_mask, key_padding):
    """``k`` and ``v`` with zero keys appended up to a multiple of ``KEY_ALIGN``, and the
    kernels' bias (``formats.mask_to_log2_bias``) of ``attn_mask`` and ``key_padding``
    (``[B, Nk]``, True keeps) with the new keys masked off.  The attention is the same;
    dK and dV flow back through the padding's slice.  Aligned calls keep their keys; a
    symbolic length is padded whatever it is (by no key where aligned): a branch on it
    would guard on ``(-N) % 16``, and a sweep over lengths compile one graph more than BF16."""
    nk = k.shape[-2]
    pad = -nk % KEY_ALIGN
    if statically_known_true(pad == 0):
        return k, v, F.mask_to_log2_bias(attn_mask, key_padding)
    k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (k, v))
    if key_padding is None:
        key_padding = torch.ones(k.shape[0], nk, dtype=torch.bool, device=k.device)
    key_padding = torch.nn.functional.pad(key_padding, (0, pad), value=False)
    if attn_mask is not None and attn_mask.shape[-1] != 1:
        masked = False if attn_mask.dtype == torch.bool else -math.inf
        attn_mask = torch.nn.functional.pad(attn_mask, (0, pad), value=masked)
    return k, v, F.mask_to_log2_bias(attn_mask, key_padding)


# The host side passes quantized tensors as these bundles; the ops take them flat.
class Quantized(NamedTuple):
    """A tensor in 8 bits: its codes and the float32 scales they are multiplied by."""

    codes: torch.Tensor
    scale: torch.Tensor


class Operands(NamedTuple):
    """The forward's Q, K and V as ``fp4attn::quantize`` makes them (V stored K-major)."""

    q: Quantized
    k: Quantized
    v: Quantized

    @classmethod
    def of(cls, q8, k8, v_t, q_scale, k_scale, v_scale) -> Operands:
        """From ``fp4attn::quantize``'s outputs (and the ops' argument order)."""
        return cls(Quantized(q8, q_scale), Quantized(k8, k_scale), Quantized(v_t, v_scale))

    def flat(self) -> tuple:
        return self.q.codes, self.k.codes, self.v.codes, self.q.scale, self.k.scale, self.v.scale


class GradOperands(NamedTuple):
    """What ``fp4attn::bwd`` takes besides the forward's operands: dO's codes (E5M2; E4M3
    for the one-kernel backward), delta = rowsum(dO * O) from the quantized dO, and the
    products' Q and K: E4M3 copies, or the forward's INT8 codes themselves for the
    one-kernel backward."""

    do: Quantized
    delta: torch.Tensor
    qe: Quantized
    ke: Quantized


def quantized_forward(q, k, v, bias, sm_scale, causal, fmt, p_mode, diagonal=0, window=0, q_documents=None,
                      k_documents=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Operands]:
    """quantize + fwd: the output, its LSE, the row reference and the quantized operands
    (what backward needs); ``sm_scale`` a number (``lowp_attention`` folds any other into Q,
    ``formats.fold_scale``)."""
    operands = Operands.of(*torch.ops.fp4attn.quantize(q, k, v, float(sm_scale), fmt))
    out, lse, row_ref = torch.ops.fp4attn.fwd(*operands.flat(), bias, causal, p_mode, q.dtype, diagonal, window,
                                              q_documents, k_documents)
    return out, lse, row_ref, operands


def grad_operands(dout, out, lse, row_ref, operands: Operands, p_mode: str, fused: bool = False) -> GradOperands:
    """dO quantized against the forward's row reference, delta, and Q's and K's E4M3 copies
    (aten code: Inductor fuses it into the backward graph).  ``fused``
    (``kernels.fused_backward_applies``): the one-kernel backward's operands instead, dO in
    E4M3 and the forward's INT8 codes for the products, and the graph derives no copies."""
    do8, do_scale = F.quantize_do(dout, lse, row_ref, p_mode, F.E4M3 if fused else F.E5M2)
    delta = (do8.float() * do_scale[..., None, None] * out.float()).sum(dim=-1)
    if fused:
        return GradOperands(Quantized(do8, do_scale), delta, operands.q, operands.k)
    qe, qe_scale, ke, ke_scale = F.backward_operands(*operands.q, *operands.k)
    return GradOperands(Quantized(do8, do_scale), delta, Quantized(qe, qe_scale), Quantized(ke, ke_scale))


def quantized_backward(grad: GradOperands, operands: Operands, bias, row_ref, sm_scale: float, causal: bool,
                       p_mode: str, out_dtype, grads_contiguous: bool, diagonal=0, window=0, q_documents=None,
                       k_documents=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV by ``fp4attn::bwd``.  Ke's scales are read by dQ's product alone: with the
    softmax scale folded into them the op returns dQ w.r.t. Q itself, rounded to its dtype
    once, and no elementwise kernel rescales it after."""
    (q8, k8, v_t, q_scale, k_scale, v_scale), (ke, ke_scale) = operands.flat(), grad.ke
    return torch.ops.fp4attn.bwd(*grad.do, grad.delta, q8, k8, v_t, q_scale, k_scale, v_scale, *grad.qe, ke,
                                 ke_scale * sm_scale, bias, row_ref, causal, p_mode, out_dtype, grads_contiguous,
                                 diagonal, window, q_documents, k_documents)


@ops.define("by_length")
def attention_by_length(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, scale: float,
    is_causal: bool, fmt: str, p_mode: str, min_keys: int, diagonal: int = 0, window: int = 0,
    key_padding: torch.Tensor | None = None, q_documents: torch.Tensor | None = None,
    k_documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low precision when the call has at least ``min_keys`` keys, SDPA otherwise: the
    cost model's crossover as a branch at run time, so a dynamic-length graph neither
    specialises nor recompiles at it.  Opaque to Inductor, hence inference only.
    Arguments as ``attention.lowp_attention``'s.  Returns the output and which rows had no
    visible key (bool ``[B, H, Nq]``), whose output either path leaves for
    ``attention.empty_row_fill``."""
    if k.shape[-2] >= min_keys:
        k, v, bias = align_keys(k, v, attn_mask, key_padding)
        out, lse = quantized_forward(q, k, v, bias, scale, is_causal, fmt, p_mode, diagonal, window, q_documents,
                                     documents.pad_keys(k_documents, k.shape[-2]))[:2]
        return out, lse == -math.inf
    out, empty = sdpa_with_structure(q, k, v, attn_mask, scale, is_causal, diagonal, window, key_padding, q_documents,
                                     k_documents)
    return ops.bnhd_like(out), empty


def sdpa_with_structure(q, k, v, attn_mask, scale, is_causal, diagonal=0, window=0, key_padding=None,
                        q_documents=None, k_documents=None):
    """BF16 SDPA over what ``lowp_attention``'s arguments mean (the causal structure, key
    padding and documents as a boolean mask): the output and the rows with no visible
    key, as ``formats.mask_to_log2_bias`` counts them."""
    if attn_mask is None and key_padding is None and not (diagonal or window) and q_documents is None:
        # SDPA's own causal structure, or none: its is_causal (the flash/cuDNN backends take it)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                                               enable_gqa=k.shape[1] != q.shape[1])
        return out, torch.zeros(q.shape[:3], dtype=torch.bool, device=q.device)
    nq, nk = q.shape[-2], k.shape[-2]
    structure = F.visible(torch.arange(nq, device=q.device)[:, None], torch.arange(nk, device=q.device)[None, :],
                          is_causal, diagonal, window)
    if q_documents is not None:
        same = documents.same_document(q_documents, k_documents)
        structure = same if structure is None else structure & same
    bias = F.mask_to_log2_bias(attn_mask, key_padding)  # what the kernels would read
    keep = structure
    if key_padding is not None:
        pad = key_padding[:, None, None, :]
        keep = pad if keep is None else keep & pad
    if keep is not None:  # SDPA's GPU backends take a mask or is_causal, not both
        if attn_mask is None or attn_mask.dtype == torch.bool:
            attn_mask = keep if attn_mask is None else attn_mask & keep
        else:
            attn_mask = attn_mask.masked_fill(~keep, -math.inf)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)  # SDPA takes an additive mask in the inputs' dtype
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    visible = structure  # here a mask, key padding or the structure is set
    if bias is not None:
        visible = bias > F.MASKED_LOG2 if visible is None else visible & (bias > F.MASKED_LOG2)
    return out, ~visible.expand(*q.shape[:3], nk).any(-1)


@torch.library.register_fake("fp4attn::by_length")
def _(q, k, v, attn_mask, scale, is_causal, fmt, p_mode, min_keys, diagonal=0, window=0, key_padding=None,
      q_documents=None, k_documents=None):
    return ops.bnhd_empty(q, q.shape[1], q.shape[2], v.shape[-1], q.dtype), q.new_empty(q.shape[:3], dtype=torch.bool)
