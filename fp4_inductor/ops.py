"""Custom ops ``torch.ops.fp4attn.quantize``, ``fwd``, ``bwd`` and ``bf16_bwd`` (``by_length``,
which composes them, is defined beside the host code it runs, in ``quantized.py``).

``quantize`` turns Q, K and V into the forward's operands; ``fwd`` and ``bwd`` take the
quantized operands.  Where a GPU kernel exists it runs; on the CPU ``formats.py`` and the
reference emulation in ``reference.py`` compute the same numbers.  On a GPU the float64
reference runs only when asked (``FP4ATTN_REFERENCE_ON_GPU=1``, for checks): a kernel that
fails, or a call no kernel takes, raises :class:`KernelError` with the call's shapes
rather than running orders of magnitude slower behind a warning.
"""

from __future__ import annotations

import logging
import os

import torch

from . import reference
from . import formats as F
from .kernels import backward_kernel, bf16_backward, forward_kernel, quantize_kernel

log = logging.getLogger(__name__)


class KernelError(RuntimeError):
    """A GPU kernel of ours failed, or none takes the call: the op and its operands' shapes."""

# The ops are defined with ``torch.library.Library`` rather than ``custom_op``: the same
# schema, fake kernels and dispatch, without custom_op's autograd layer around each call
# (a no-op op cost 24 us through custom_op against 8.4 on a CPU host,
# benchmarks/lab/explore_forward_host.py).  None has autograd of its own: ``attention.py``
# attaches the gradient around quantize + fwd and calls bwd from its backward, once
# differentiable.
_LIBRARY = torch.library.Library("fp4attn", "DEF")


def define(name: str):
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


def _launch(op: str, kernel, *args):
    """``kernel(*args)``, its failure raised as ours with what the call was."""
    try:
        return kernel(*args)
    except Exception as err:
        raise KernelError(f"fp4attn::{op} kernel failed for {_describe(args)}: {type(err).__name__}: {err}") from err


def _describe(args) -> str:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else "?"
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors[:6])
    return f"operands {shapes} on {device}"


def _reference_asked() -> bool:
    return os.environ.get("FP4ATTN_REFERENCE_ON_GPU") == "1"


def _reference_allowed(op: str, *operands: torch.Tensor) -> None:
    """The reference may stand in for a kernel on the CPU, or on a GPU when asked."""
    if operands[0].is_cuda and not _reference_asked():
        name = torch.cuda.get_device_name(operands[0].device)
        raise KernelError(f"no fp4attn::{op} kernel runs {_describe(operands)} ({name}); the float64 reference "
                          "would run in its place at orders of magnitude the time: leave this site to SDPA "
                          "(policy or overrides), or set FP4ATTN_REFERENCE_ON_GPU=1 to run the reference")


def _no_work(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query or no key (SDPA's answer: zeros, and zero gradients): the formats code and
    the reference compute it at no cost, where the kernels refuse zero keys."""
    return q.numel() == 0 or k.numel() == 0


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


@define("quantize")
def quantize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, fmt: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``formats.quantize_inputs``: the forward op's operands ``(q8, k8, v_t, q_scale,
    k_scale, v_scale)``, all contiguous.

    One op rather than aten code for Inductor to fuse: on the H200 Inductor's kernels for
    these cross-row reductions took 215 us where the op's two launches take 123; in a
    Llama-3.1-8B block with RoPE, which Inductor fuses into the op's input, the op's path
    was the faster one too (docs/perf-notes/2026-12.md, "Quantization v7/v8")."""
    kernel = None if _no_work(q, k) else quantize_kernel(q, fmt)
    if kernel is not None:
        try:
            return kernel(q, k, v, sm_scale)
        except Exception as err:  # the formats code gives the same codes at GPU speed: logged each time
            log.warning("fp4attn::quantize kernel failed for %s (%s: %s); the formats code ran instead",
                        _describe((q, k, v)), type(err).__name__, err)
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


@define("fwd")
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
    kernel = None if _no_work(q, k) else forward_kernel(q, p_mode)
    if kernel is not None:
        _launch("fwd", kernel, q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out, lse, row_ref, diagonal,
                window, q_documents, k_documents)
        return out, lse, row_ref
    if not _no_work(q, k):
        _reference_allowed("fwd", q, k, v_t)
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


@define("bwd")
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
    returns; ``attention.py`` passes them times the softmax scale, for dQ w.r.t. Q.  A
    caller may pass the one-kernel backward's operands (``kernels.fused_backward_applies``):
    the forward's INT8 codes (and K's scales, times the same factor) in place of the E4M3
    copies ``qe``/``ke``, and dO in E4M3 rather than E5M2; any other path derives the copies
    from them.  All
    three are stored as ``grads_empty`` lays them out: contiguous with ``grads_contiguous``
    (the attention's inputs were), else ``[B, N, H, D]``.  The kernels take any strides."""
    dq, dk, dv = grads_empty(q, k, v_t, out_dtype, grads_contiguous)
    kernel = None if _no_work(q, k) else backward_kernel(q, p_mode)
    if kernel is not None:
        _launch("bwd", kernel, do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale,
                bias, row_ref, causal, p_mode, dq, dk, dv, diagonal, window, q_documents, k_documents)
        return dq, dk, dv
    if not _no_work(q, k):
        _reference_allowed("bwd", do, q, k, v_t)
    if ke.dtype == torch.int8:  # the one-kernel backward's operands: the reference reads E4M3 copies
        qe, qe_scale, ke, ke_scale = F.backward_operands_in_place_of_codes(q, q_scale, k, k_scale, ke_scale)
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


@define("bf16_bwd")
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
    if q.is_cuda and not _no_work(q, k) and not _reference_asked():
        results = _launch("bf16_bwd", bf16_backward.backward, dout, q, k, v, out, lse, bias, scale, causal, diagonal,
                          window)
    else:
        results = reference.bf16_attention_backward(dout, q, k, v, out, lse, bias, scale, causal, diagonal, window)
    # The layout the fake promises (a copy only where the kernel's differs).
    return tuple(g if g.stride() == torch.empty_like(t, device="meta").stride() else torch.empty_like(t).copy_(g)
                 for g, t in zip(results, (q, k, v)))


@torch.library.register_fake("fp4attn::bf16_bwd")
def _(dout, q, k, v, out, lse, bias, scale, causal, diagonal=0, window=0):
    return tuple(torch.empty_like(t) for t in (q, k, v))
