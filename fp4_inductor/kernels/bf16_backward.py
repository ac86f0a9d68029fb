"""The BF16 backward of the hybrid training path (``attention.py``, path ``fp8+bf16bwd``).

Our FP8 forward saves the BF16 Q, K, V, its O and its natural-log LSE, as BF16 SDPA does;
the gradient is then left to a FlashAttention-class BF16 backward, which takes O and LSE
as inputs and recomputes P = exp(scale Q K^T + bias - LSE) from the BF16 operands.  The
fastest one this device has that applies the site's structure exactly is chosen, per call:

- ``fa4``: FlashAttention-4 (``flash_attn.cute``, when installed): no bias; the causal
  structure when its diagonal is the bottom-right one (``Nk - Nq``, 0 for square
  calls), windows relative to it; GQA natively.
- ``cudnn``: torch's cuDNN backward: an additive bias (masks, key padding); SDPA's
  top-left causal structure (diagonal 0), no window; GQA by repeating K/V.
- ``flash``: torch's flash backward (FlashAttention-2): FA4's structures, GQA natively.

``FP4ATTN_BF16_BACKWARD=cudnn`` (or ``flash``, ``fa4``) keeps to one backend where it
applies (none otherwise), which is how benchmarks time each.

A call none of them applies to (a mask with a window, say) has no BF16 backward: the
policy does not offer the path there (``available``), and the ops' reference
(``reference.bf16_attention_backward``) computes it where no kernel runs at all (CPU).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from ..formats import LN2

# cuDNN's SDPA backward on sm_90 goes to D = 128 in torch's checks for it.
CUDNN_MAX_HEAD_DIM = 128
FLASH_MAX_HEAD_DIM = 256


@functools.cache
def has_fa4() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None


def bottom_right(nq: int, nk: int, diagonal) -> bool:
    """Whether the causal diagonal is FlashAttention's own (the last query sees every key)."""
    return isinstance(diagonal, int) and diagonal == nk - nq


def available(device: torch.device, d: int, dv: int, nq: int, nk: int, causal: bool, diagonal, window: int,
              masked: bool) -> str | None:
    """The backend that would run a call with this structure on ``device`` (the reference
    on a device without CUDA), or None where none applies.  ``masked``: the call has a
    bias (a mask or key padding)."""
    if device.type != "cuda":
        return "reference"
    only = os.environ.get("FP4ATTN_BF16_BACKWARD")
    flash_structure = not masked and (not causal or bottom_right(nq, nk, diagonal))
    cudnn_structure = not window and (not causal or (isinstance(diagonal, int) and diagonal == 0))
    applies = {
        "fa4": flash_structure and has_fa4() and d % 8 == 0 and dv % 8 == 0 and max(d, dv) <= 256,
        "cudnn": cudnn_structure and d == dv and d <= CUDNN_MAX_HEAD_DIM and d % 8 == 0,
        "flash": flash_structure and d == dv and d <= FLASH_MAX_HEAD_DIM and d % 8 == 0,
    }
    return next((name for name, ok in applies.items() if ok and only in (None, name)), None)


def backward(dout, q, k, v, out, lse, bias, scale: float, causal: bool, diagonal: int, window: int):
    """dQ, dK, dV ``[B, H(kv), N, D]`` by the backend ``available`` picks (CUDA only).
    ``lse``: natural log, ``[B, H, Nq]``, -inf for rows with no visible key; ``bias``:
    float32 log2 units broadcastable to the scores, or None."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    name = available(q.device, d, v.shape[-1], nq, nk, causal, diagonal, window, bias is not None)
    if name is None or name == "reference":
        raise RuntimeError(f"no BF16 backward applies to this call (causal={causal}, diagonal={diagonal}, "
                           f"window={window}, bias={bias is not None})")
    # Rows with no visible key have LSE -inf: FlashAttention's convention for them is +inf,
    # which makes every recomputed P zero (and their gradients zero) instead of NaN.
    lse = torch.where(lse == -math.inf, math.inf, lse)
    return _BACKENDS[name](dout, q, k, v, out, lse, bias, scale, causal, diagonal, window)


def _window_sizes(nq, nk, causal, diagonal, window):
    """FlashAttention's (left, right) window for a bottom-right causal structure: key j is
    visible to query i iff i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right."""
    if not causal:
        return None, None
    return (window - 1 if window else None), 0


def _fa4(dout, q, k, v, out, lse, bias, scale, causal, diagonal, window):
    from flash_attn.cute.interface import _flash_attn_bwd

    left, right = _window_sizes(q.shape[2], k.shape[2], causal, diagonal, window)
    # FA4 takes [B, N, H, D] with unit stride on D: the transposes are views.
    dq, dk, dv = _flash_attn_bwd(*(t.transpose(1, 2) for t in (q, k, v, out, dout)), lse.contiguous(),
                                 softmax_scale=scale, causal=causal and not window,
                                 window_size_left=left, window_size_right=right if window else None)[:3]
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cudnn(dout, q, k, v, out, lse, bias, scale, causal, diagonal, window):
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:  # torch's cuDNN attention takes one K/V head per query head
        k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    if bias is not None:  # log2 units to the scores' natural units, in the inputs' dtype
        bias = (bias * LN2).to(q.dtype).expand(q.shape[0], h, q.shape[2], k.shape[2])
    # O and dO in Q's layout, as torch's own cuDNN forward lays O out: torch caches cuDNN's
    # plans under a key without their strides, so a call with ours (O is [B, N, H, D]
    # underneath) and one of torch's with the same shapes shared a plan, and whichever came
    # second got wrong gradients (1.52 rel-L2 for torch's after ours; H100, 2026-12-06).
    out, dout = (t if t.stride() == q.stride() else torch.empty_like(q).copy_(t) for t in (out, dout))
    # None stands for the undefined tensors of dense calls without dropout: a defined
    # cum_seq would mean a packed (varlen) call.
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1), None, None, bias, None, None, q.shape[2], k.shape[2], 0.0,
        causal, scale=scale)
    if hkv != h:
        dk, dv = (t.unflatten(1, (hkv, h // hkv)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _flash(dout, q, k, v, out, lse, bias, scale, causal, diagonal, window):
    left, right = _window_sizes(q.shape[2], k.shape[2], causal, diagonal, window)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # read only with dropout
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse.contiguous(), None, None, q.shape[2], k.shape[2],
        0.0, causal, rng, None, scale=scale, window_size_left=left, window_size_right=right if window else None)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_BACKENDS = {"fa4": _fa4, "cudnn": _cudnn, "flash": _flash}
