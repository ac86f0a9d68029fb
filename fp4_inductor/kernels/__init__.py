"""GPU kernels.  ``quantize_kernel``, ``forward_kernel`` and ``backward_kernel`` return a launcher for the
inputs' device, or None where no kernel applies (then the ops run the reference emulation).

``FP4ATTN_KERNELS=0`` turns the kernels off (the reference runs instead), which is how
to compare the two on one machine.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from ..formats import P_MODES, supported_head_dim


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.cache
def _module(family: str, module: str):
    """``kernels.<family>.<module>``, or None where its compiler is missing (Triton, or
    Triton without Gluon): the next kernel, or the reference path, serves."""
    try:
        return importlib.import_module(f".{family}.{module}", __name__)
    except ImportError:
        return None


def _triton_launcher(module: str, name: str):
    mod = _module("triton", module)
    return None if mod is None else getattr(mod, name)


def _applies(q: torch.Tensor) -> bool:
    """What every Triton kernel needs: an sm_90 device (``kernels_run_on``, which
    also honours ``FP4ATTN_KERNELS=0``) and a supported head dim (``formats``)."""
    return kernels_run_on(q.device) and supported_head_dim(q.shape[-1])


def _gluon_scope(q, v_t, causal, diagonal, window, structures: bool, documents) -> bool:
    """What the Gluon kernels cover besides their own ``supports``: D in {64, 128} for Q,
    K and V alike; the backward kernels (``structures=False``) no causal structure but
    SDPA's top-left one, the forward any (``formats.visible``); no document ids (not yet
    measured there)."""
    d = q.shape[-1]
    return (d in (64, 128) and v_t.shape[-2] == d and documents is None
            and (structures or not (causal and (diagonal or window))))


def kernels_run_on(device: torch.device) -> bool:
    """Whether our kernels (quantize, forward and backward) run on this device: sm_90, and
    ``FP4ATTN_KERNELS`` not 0.  Elsewhere the ops compute the same numbers by the reference."""
    if os.environ.get("FP4ATTN_KERNELS", "1") == "0" or device.type != "cuda":
        return False
    return _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


def quantize_kernel(q: torch.Tensor, fmt: str):
    """The Triton sm_90 launcher quantizing Q, K and V for fmt="fp8", else None.
    fp4's MXFP4 V is an accuracy mode and keeps the formats code."""
    if fmt != "fp8" or not _applies(q):
        return None
    return _triton_launcher("quantize", "quantize_inputs")


def forward_kernel(q: torch.Tensor, p_mode: str):
    """The sm_90 forward launcher for supported head dims, else None: the warp-specialised
    Gluon kernel for P mode direct where it covers the call (``_gluon_scope`` and
    ``kernels.gluon.attention_fwd.supports``) and measured faster (``_gluon_wins``), the
    Triton kernel for the rest (shorter rows, few queries, P modes exp and fp4, biases that
    vary over queries, other head dims, Nk not a multiple of 16); the choice is made per call, in
    ``_forward``."""
    if not _applies(q) or p_mode not in P_MODES:
        return None
    return _forward if _module("triton", "attention_fwd") is not None else None


# Where the Gluon kernel beat the Triton one in P mode direct on the H200, both on the same
# operands (benchmarks/lab/explore_dispatch.py, results/lab/explore_dispatch_h200.json,
# 2026-12-02): keys per (D, causal) and queries per sequence from which it won, and at
# least 128 of its 128-row programs (B H Nq / 128: it won with 128, lost 0.76x with 64).
# Below these its pipeline fill and drain weigh on rows of few key tiles.  Sliding
# windows: it won with 4096 keys at D = 128 (1.10-1.13x) and lost at D = 64 (0.78x); a
# window must itself reach the causal key count.
# Its exp mode (the Direct-P ablation) measured slower than the Triton kernel's: Triton.
GLUON_MIN_KEYS = {(128, False): 2048, (128, True): 4096, (64, False): 4096, (64, True): 8192}
GLUON_MIN_QUERIES = {128: 256, 64: 1024}
GLUON_MIN_ROWS = 128 * 128


def _gluon_wins(q, k, causal, window) -> bool:
    """Whether the measured crossovers above give this call to the Gluon kernel (D in
    {64, 128}, ``_gluon_scope``)."""
    b, h, nq, d = q.shape
    if window and (d == 64 or window < GLUON_MIN_KEYS[(d, True)]):
        return False
    return (k.shape[2] >= GLUON_MIN_KEYS[(d, bool(causal))] and nq >= GLUON_MIN_QUERIES[d]
            and b * h * nq >= GLUON_MIN_ROWS)


_gluon_failed: set[str] = set()  # Gluon modules whose launch failed once: not tried again


def _run_gluon(module: str, what: str, launch: str, supports_args: tuple, args: tuple) -> bool:
    """``kernels.gluon.<module>.<launch>(*args)`` where its ``supports(*supports_args)``
    holds; False leaves the call to the Triton kernel.  Gluon is experimental (an API
    change fails at compile time): a failure warns once and is remembered."""
    gluon = None if module in _gluon_failed else _module("gluon", module)
    if gluon is None or not gluon.supports(*supports_args):
        return False
    try:
        getattr(gluon, launch)(*args)
        return True
    except Exception as err:
        _gluon_failed.add(module)
        warnings.warn(f"fp4attn Gluon {what} kernel failed ({err!r}); using the Triton kernel", RuntimeWarning,
                      stacklevel=3)
        return False


def _forward(q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out, lse, row_ref, diagonal=0, window=0,
             q_documents=None, k_documents=None):
    args = (q, k, v_t, q_scale, k_scale, v_scale, bias, causal, p_mode, out, lse, row_ref, diagonal, window)
    if p_mode == "direct" and _gluon_scope(q, v_t, causal, diagonal, window, True, q_documents) \
            and _gluon_wins(q, k, causal, window) \
            and _run_gluon("attention_fwd", "forward", "attention_forward",
                           (q, k, v_t, q_scale, bias, p_mode, lse, row_ref), args):
        return
    _module("triton", "attention_fwd").attention_forward(*args, q_documents, k_documents)


def backward_kernel(q: torch.Tensor, p_mode: str):
    """The sm_90 backward launcher, under the forward's conditions, else None: per direction
    the warp-specialised Gluon kernel where it covers the call (``_gluon_scope``, no
    documents, and ``kernels.gluon.attention_bwd_dq.supports`` for dQ,
    ``attention_bwd_dkdv.supports`` for dK/dV), the Triton kernel otherwise; the choice is
    made per call, in ``_backward``.  It computes the reference's numbers; whether it beats
    BF16 attention at a shape is the policy's question (its cost table times both in
    training)."""
    if not _applies(q) or p_mode not in P_MODES:
        return None
    return _backward if _module("triton", "attention_bwd") is not None else None


def _gluon_dq(ops, dq, bias, p_mode) -> bool:
    """dQ by the Gluon kernel where it applies; False leaves it to the Triton kernel.
    ``ops``: the call's ``attention_bwd_prep.BackwardOperands``, ``bias`` as the call gave it."""
    return _run_gluon("attention_bwd_dq", "dQ", "dq_backward",
                      (ops.do, ops.delta, ops.q, ops.k, ops.v, ops.q_scale, ops.ke_t, ops.k_scale, ops.ke_scale,
                       ops.row_ref, bias, p_mode, dq),
                      (ops.do, ops.do_scale, ops.delta, ops.q, ops.k, ops.v, ops.q_scale, ops.k_scale, ops.v_scale,
                       ops.ke_t, ops.ke_scale, ops.row_ref, ops.causal, dq, ops.key_rows))


def _gluon_dkdv(ops, dk, dv, bias, p_mode) -> bool:
    """dK and dV by the Gluon kernel where it applies; False leaves them to the Triton kernel."""
    args = (ops.do, ops.do_t, ops.do_scale, ops.delta, ops.q, ops.qe_t, ops.qe_scale, ops.k, ops.v, ops.q_scale,
            ops.k_scale, ops.v_scale, ops.row_ref, ops.causal, dk, dv)
    return _run_gluon("attention_bwd_dkdv", "dK/dV", "dkdv_backward", args + (bias, p_mode), args + (ops.key_rows,))


def fused_backward_enabled() -> bool:
    """``FP4ATTN_FUSED_BACKWARD=1``: the one-kernel backward (``kernels.gluon.attention_bwd_fused``,
    ``reference.fused_attention_backward``'s numerics) where it covers the call.  Read where
    the backward's operands are made (``fused_backward_applies``): a graph compiled with it
    keeps it.  Off by default until the H200 measures it faster than the two kernels
    (docs/perf-notes/2026-12.md, "v3 and D = 64 measured" and "An H100 day")."""
    return os.environ.get("FP4ATTN_FUSED_BACKWARD", "0") == "1"


@torch.compiler.assume_constant_result  # Dynamo, tracing an autograd.Function's backward, takes its answer
def fused_backward_applies(q, k, v_t, bias, causal, p_mode, diagonal=0, window=0, q_documents=None,
                           grad_dtype=torch.bfloat16) -> bool:
    """Whether the one-kernel backward is for this call (the switch on, an sm_90 GPU, the
    structures, sizes, head dims and gradient dtype it covers), from what a traced graph
    knows: its operands then go to the op (``quantized.grad_operands``: dO in E4M3, the
    forward's INT8 codes for the products), and the backward graph derives no E4M3 copies of
    Q and K.  Where its launch refuses the call after all, the two kernels' preparation
    derives them (``attention_bwd_prep.prepare``)."""
    if not (fused_backward_enabled() and _applies(q)) or os.environ.get("TRITON_INTERPRET", "0") == "1" \
            or "attention_bwd_fused" in _gluon_failed:
        return False
    fused = _module("gluon", "attention_bwd_fused")
    return fused is not None and fused.covers(q, k, v_t, bias, causal, p_mode, diagonal, window, q_documents,
                                              grad_dtype)


def _backward(do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, bias, row_ref,
              causal, p_mode, dq, dk, dv, diagonal=0, window=0, q_documents=None, k_documents=None):
    if ke.dtype == torch.int8:  # the forward's codes (fused_backward_applies): the one-kernel backward's operands
        args = (do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale)
        if os.environ.get("TRITON_INTERPRET", "0") != "1" \
                and _run_gluon("attention_bwd_fused", "fused backward", "fused_backward",
                               args + (bias, row_ref, causal, p_mode, dq, dk, dv, diagonal, window, q_documents),
                               args + (row_ref, causal, dq, dk, dv)):
            return  # else the preparation derives the copies the two kernels read
    ops = _module("triton", "attention_bwd_prep").prepare(
        do, do_scale, delta, q, k, v_t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, bias, row_ref, causal,
        p_mode, dk, dv, diagonal, window, q_documents, k_documents)
    if ops is None:  # no query or no key: dK and dV zeroed, dQ empty
        return
    # The Gluon kernels do not run under the interpreter (the Triton kernels' emulation then).
    gluon = _gluon_scope(q, v_t, causal, diagonal, window, False, q_documents) and not ops.emulate
    triton_bwd = _module("triton", "attention_bwd")
    if not (gluon and _gluon_dkdv(ops, dk, dv, bias, p_mode)):
        triton_bwd.dkdv_backward(ops, dk, dv)
    if not (gluon and _gluon_dq(ops, dq, bias, p_mode)):
        triton_bwd.dq_backward(ops, dq)
