"""Custom ops ``torch.ops.fp4attn.quantize``, ``fwd``, ``bwd``, ``bf16_bwd`` and ``by_length``.

``quantize`` turns Q, K and V into the forward's operands; ``fwd`` and ``bwd`` take the
quantized operands.  Where a GPU kernel exists it runs; everywhere else, and if a kernel
fails at run time (with one warning), ``formats.py`` and the reference emulation in
``reference.py`` compute the same numbers.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import documents, reference
from . import formats as F
from .kernels import backward_kernel, bf16_backward, forward_kernel, quantize_kernel

_warned: set[str] = set()

# The ops are defined with ``torch.library.Library`` rather than ``custom_op``: the same
# schema, fake kernels and dispatch, without custom_op's autograd layer around each call
# (a no-op op cost 24 us through custom_op against 8.4 on a CPU host,
# benchmarks/lab/explore_forward_host.py).  None has autograd of its own: ``attention.py``
# attaches the gradient around quantize + fwd and calls bwd from its backward, once
# differentiable.
_LIBRARY = torch.library.Library("fp4attn", "DEF")


def _op(name: str):
    """Define ``fp4attn::<name>`` with the decorated function as its kernel on every
    device, as custom_op would: the schema inferred from the annotations (ints as SymInt,
    so a symbolic length does not specialise the graph), tagged PT2-compliant, and the
    kernel hidden from Dynamo (an op run eagerly under it, after a graph break, must not
    be traced into).  ``torch.library.register_fake`` gives it the fake kernel."""
    def register(fn):
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(name, torch.compiler.disable(fn), "CompositeExplicitAutograd")
        return fn
    return register


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def bnhd_empty(like: torch.Tensor, heads: int, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, N, D]`` stored as ``[B, N, H, D]``: the layout ``out.transpose(1, 2)
    .reshape(B, N, H * D)`` reads without a copy (and the kernels write)."""
    return torch.empty(like.shape[0], rows, heads, dim, dtype=dtype, device=like.device).transpose(1, 2)


def grads_empty(q: torch.Tensor, k: torch.Tensor, v_t: torch.Tensor, dtype: torch.dtype, contiguous: bool):
    """dQ, dK and dV buffers ``[B, H, N, D]`` shaped like ``q``, ``k`` and V (``v_t`` is
    stored ``[B, H, Dv, N]``):
    contiguous where the inputs were (leaves, say, whose ``.grad`` autograd would otherwise
    re-lay out, a strided copy a step), else in ``bnhd_empty``'s layout (what a
    projection's ``view(B, N, H, D).transpose(1, 2)`` gives and its backward reads without
    a copy)."""

    def empty(like, b, h, n, d):
        if contiguous:
            return torch.empty(b, h, n, d, dtype=dtype, device=like.device)
        return bnhd_empty(like, h, n, d, dtype)

    b, hkv, dv, nk = v_t.shape
    return empty(q, *q.shape), empty(k, *k.shape), empty(v_t, b, hkv, nk, dv)


def bnhd_like(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, N, D]`` in ``bnhd_empty``'s layout (a copy only where it differs),
    for ops whose fake promises that layout."""
    b, h, n, d = x.shape
    if x.transpose(1, 2).is_contiguous():
        return x
    out = bnhd_empty(x, h, n, d, x.dtype)
    out.copy_(x)
    return out


@_op("quantize")
def quantize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, fmt: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``formats.quantize_inputs``: the forward op's operands ``(q8, k8, v_t, q_scale,
    k_scale, v_scale)``, all contiguous.

    One op rather than aten code for Inductor to fuse: on the H200 Inductor's kernels for
    these cross-row reductions took 215 us where the op's two launches take 123; in a
    Llama-3.1-8B block with RoPE, which Inductor fuses into the op's input, the op's path
    was the faster one too (docs/perf-notes/)."""
    kernel = quantize_kernel(q, fmt)
    if kernel is not None:
        try:
            return kernel(q, k, v, sm_scale)
        except Exception as err:  # never kill the model: same numbers from the formats code
            _warn_once("quantize", f"fp4attn quantization kernel failed ({err!r}); using the formats code")
    return tuple(t.contiguous() for t in F.quantize_inputs(q, k, v, sm_scale, fmt))


@torch.library.register_fake("fp4attn::quantize")
def _(q, k, v, sm_scale, fmt):
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    return (
        q.new_empty(b, h, nq, d, dtype=torch.int8),
        q.new_empty(b, hkv, nk, d, dtype=torch.int8),
        q.new_empty(b, hkv, dv, nk, dtype=F.E4M3),
        q.new_empty(b, h, nq, dtype=torch.float32),
        q.new_empty(b, hkv, F.scale_blocks(nk), dtype=torch.float32),
        q.new_empty(b, hkv, dtype=torch.float32),
    )


@_op("fwd")
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v_t: torch.Tensor,
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
    """Attention over INT8 Q ``[B, H, Nq, D]`` (per-token scale), INT8 K ``[B, Hkv, Nk, D]``
    (per-block scale), E4M3 V stored K-major ``[B, Hkv, Dv, Nk]`` (per-head scale) and an
    optional float32 log2-unit bias broadcastable to ``[B, H, Nq, Nk]``; ``causal`` with
    ``diagonal`` and ``window`` is the causal structure (``formats.visible``);
    ``q_documents`` [B, Nq] and ``k_documents`` [B, Nk] integer ids, the document
    structure (``documents.py``).
    Returns O ``[B, H, Nq, Dv]`` (stored ``[B, Nq, H, Dv]``), the natural-log LSE of the
    represented probabilities and the integer row reference of the P codes (float32
    ``[B, H, Nq]`` each; see ``reference.attention_forward``).  A row with no visible key
    gets O = 0 and LSE = -inf."""
    b, h, nq, _ = q.shape
    out = bnhd_empty(q, h, nq, v_t.shape[-2], out_dtype)
    lse, row_ref = (torch.empty(b, h, nq, dtype=torch.float32, device=q.device) for _ in range(2))
    kernel = forward_kernel(q, p_mode)
    if kernel is not None:
        try:
            kernel(q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out, lse, row_ref, diagonal, window,
                   q_documents, k_documents)
            return out, lse, row_ref
        except Exception as err:  # never kill the model: same numbers from the reference
            _warn_once("fwd", f"fp4attn forward kernel failed ({err!r}); using the reference path")
    for dst, src in zip((out, lse, row_ref), reference.attention_forward(
            q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out_dtype, diagonal, window, q_documents,
            k_documents)):
        dst.copy_(src)
    return out, lse, row_ref


@torch.library.register_fake("fp4attn::fwd")
def _(q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out_dtype, diagonal=0, window=0, q_documents=None,
      k_documents=None):
    b, h, nq, _ = q.shape
    row = q.new_empty(b, h, nq, dtype=torch.float32)
    return bnhd_empty(q, h, nq, v_t.shape[-2], out_dtype), row, torch.empty_like(row)


@_op("bwd")
def attention_bwd(
    do: torch.Tensor,
    do_scale: torch.Tensor,
    delta: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v_t: torch.Tensor,
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
    grads_contiguous: bool = False,
    diagonal: int = 0,
    window: int = 0,
    q_documents: torch.Tensor | None = None,
    k_documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients from the forward's saved operands; see ``reference.attention_backward``.
    dQ is w.r.t. Q times the softmax scale for the Ke scales ``formats.backward_operands``
    returns; ``attention.py`` passes them times the softmax scale, for dQ w.r.t. Q.  All
    three are stored as ``grads_empty`` lays them out: contiguous with ``grads_contiguous``
    (the attention's inputs were), else ``[B, N, H, D]``.  The kernels take any strides."""
    dq, dk, dv = grads_empty(q, k, v_t, out_dtype, grads_contiguous)
    kernel = backward_kernel(q, p_mode)
    if kernel is not None:
        try:
            kernel(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale,
                   bias, row_ref, causal, p_mode, dq, dk, dv, diagonal, window, q_documents, k_documents)
            return dq, dk, dv
        except Exception as err:  # never kill the model: same numbers from the reference
            _warn_once("bwd", f"fp4attn backward kernel failed ({err!r}); using the reference path")
    grads = reference.attention_backward(
        do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale,
        bias, row_ref, causal, p_mode, out_dtype, diagonal, window, q_documents, k_documents,
    )
    for dst, src in zip((dq, dk, dv), grads):
        dst.copy_(src)
    return dq, dk, dv


@torch.library.register_fake("fp4attn::bwd")
def _(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, bias, row_ref, causal,
      p_mode, out_dtype, grads_contiguous=False, diagonal=0, window=0, q_documents=None, k_documents=None):
    return grads_empty(q, k, v_t, out_dtype, grads_contiguous)


@_op("bf16_bwd")
def attention_bf16_bwd(
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
    """The hybrid path's backward: dQ, dK, dV (laid out as Q, K and V) from the BF16
    inputs, the FP8 forward's O and its natural-log LSE, by a BF16 FlashAttention-class
    kernel (``kernels.bf16_backward``); ``bias`` is the kernels' float32 log2-unit bias of
    the call's unpadded keys.  Where no kernel runs, ``reference.bf16_attention_backward``."""
    results = None
    if q.is_cuda:
        try:
            results = bf16_backward.backward(dout, q, k, v, out, lse, bias, scale, causal, diagonal, window)
        except Exception as err:  # never kill the model: same math from the reference
            _warn_once("bf16_bwd", f"fp4attn BF16 backward kernel failed ({err!r}); using the reference path")
    if results is None:
        results = reference.bf16_attention_backward(dout, q, k, v, out, lse, bias, scale, causal, diagonal, window)
    # The layout the fake promises (a copy only where the kernel's differs).
    return tuple(g if g.stride() == torch.empty_like(t, device="meta").stride() else torch.empty_like(t).copy_(g)
                 for g, t in zip(results, (q, k, v)))


@torch.library.register_fake("fp4attn::bf16_bwd")
def _(dout, q, k, v, out, lse, bias, scale, causal, diagonal=0, window=0):
    return tuple(torch.empty_like(t) for t in (q, k, v))


# Keys a call's K and V are padded to a multiple of: the Gluon kernels read V^T's rows and
# K's 16-key chunks as TMA boxes (16-byte aligned), and the Triton kernel falls back to byte
# loads of V^T without them (a Wan2.1 480p video's 32760 tokens: 338 ms against 24 ms for
# 32768 tokens on the Gluon kernel, H200, docs/perf-notes/).
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
    """What ``fp4attn::bwd`` takes besides the forward's operands: E5M2 dO, delta =
    rowsum(dO * O) from the quantized dO, and the E4M3 copies of Q and K."""

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


def grad_operands(dout, out, lse, row_ref, operands: Operands, p_mode: str) -> GradOperands:
    """dO quantized against the forward's row reference, delta, and Q's and K's E4M3 copies
    (aten code: Inductor fuses it into the backward graph)."""
    do8, do_scale = F.quantize_do(dout, lse, row_ref, p_mode)
    delta = (do8.float() * do_scale[..., None, None] * out.float()).sum(dim=-1)
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


@_op("by_length")
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
    return bnhd_like(out), empty


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
    return bnhd_empty(q, q.shape[1], q.shape[2], v.shape[-1], q.dtype), q.new_empty(q.shape[:3], dtype=torch.bool)
