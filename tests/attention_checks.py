"""How model-level tests judge attention (tests only).

A tolerance is a multiple of a low-precision reference's own error, as FlashAttention's
tests bound a kernel's error by k times that of the same math in the kernel's precision:
``lowp_sdpa`` is eager attention with FP8-like roundings (INT8 Q and K per token, E4M3 V per
head and P per row, E5M2 dO and E4M3 dS in backward), written from the definitions and
sharing no code with ``fp4_inductor``.  Both errors are taken against fp64 eager.

``reference_fault`` breaks the reference path (what ``fp4attn::fwd``/``bwd`` run on the
CPU) on purpose: a check that still passes under a halved softmax scale, an ignored mask
or a zeroed output cannot tell right attention from wrong.  ``FP4ATTN_TEST_FAULT=<fault>``
applies one to every test of a run (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import pytest
import torch

from fp4_inductor import reference
from helpers import rel_l2

FAULTS = ("half_scale", "mask_ignored", "zero_output")


def _rounded(x: torch.Tensor, dtype: torch.dtype, dims) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (int8 or a float8) with one amax scale per slice over
    ``dims``, returned dequantized."""
    fmax = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = x.abs().amax(dims, keepdim=True).clamp_min(1e-30) / fmax
    y = x / scale
    y = y.round().clamp(-fmax, fmax) if dtype == torch.int8 else y.to(dtype).to(x.dtype)
    return y * scale


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` in MXFP4: blocks of 32 along ``dim`` sharing a power-of-two scale that puts
    the block's amax at most 6, each value rounded to the nearest E2M1 magnitude."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -n % 32)).unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6)))
    grid = E2M1.to(x)
    nearest = ((blocks.abs() / scale)[..., None] - grid).abs().argmin(-1)
    return (blocks.sign() * grid[nearest] * scale).flatten(-2)[..., :n].movedim(-1, dim)


class _LowpAttention(torch.autograd.Function):
    """Softmax attention over a float bias: Q and K in INT8 per token, V and P in E4M3 (V
    per head, P per row with its maximum at 256) or, for ``fmt="fp4"``, in MXFP4 (V over
    32 tokens, P over 32 keys); the row sum from the rounded P; rounding straight through
    in backward, which uses the same P with dO in E5M2 and dS in E4M3, one scale per row."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, fmt):
        q8, k8 = _rounded(q * scale, torch.int8, -1), _rounded(k, torch.int8, -1)
        v8 = _rounded(v, torch.float8_e4m3fn, (-2, -1)) if fmt == "fp8" else _mxfp4(v, -2)
        p = torch.softmax(q8 @ k8.transpose(-1, -2) + bias, dim=-1).nan_to_num(0.0)
        if fmt == "fp8":
            p = _rounded(p, torch.float8_e4m3fn, -1) * (256 / 448)  # the row maximum at 256, not 448
        else:
            p = _mxfp4(p, -1)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        out = p @ v8
        ctx.save_for_backward(q8, k8, v8, p, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q8, k8, v8, p, out = ctx.saved_tensors
        do = _rounded(dout, torch.float8_e5m2, -1)
        ds = p * (do @ v8.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
        ds = _rounded(ds, torch.float8_e4m3fn, -1)
        return ds @ k8 * ctx.scale, ds.transpose(-1, -2) @ q8, p.transpose(-1, -2) @ do, None, None, None


def lowp_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              fmt="fp8"):
    """``F.scaled_dot_product_attention`` (no dropout) in ``_LowpAttention``'s precision."""
    assert dropout_p == 0.0
    nq, nk = query.shape[-2], key.shape[-2]
    if key.shape[-3] != query.shape[-3]:
        key, value = (t.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3) for t in (key, value))
    bias = torch.zeros(nq, nk, dtype=query.dtype, device=query.device)
    if is_causal:
        bias = bias.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(), -math.inf)
    if attn_mask is not None:
        bias = torch.where(attn_mask, bias, -math.inf) if attn_mask.dtype == torch.bool else bias + attn_mask
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _LowpAttention.apply(query, key, value, bias.to(query.dtype), scale, fmt)


@contextlib.contextmanager
def lowp_reference(fmt="fp8"):
    """Every ``F.scaled_dot_product_attention`` call (HF's sdpa attention,
    ``nn.MultiheadAttention``'s slow path) runs ``lowp_sdpa`` in ``fmt``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", functools.partial(lowp_sdpa, fmt=fmt))
        yield


def peaked_hf(model: torch.nn.Module, gain: float) -> torch.nn.Module:
    """An HF model's query and key projections times ``gain`` (GPT-2's fused c_attn: its Q
    and K columns): random-init models attend almost uniformly (scores of std ~0.3), where
    a wrong scale or an ignored mask hardly moves the output."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("q_proj", "k_proj", "query", "key"):
                mod.weight.mul_(gain)
                if mod.bias is not None:
                    mod.bias.mul_(gain)
            elif leaf == "c_attn":  # Conv1D: weight [E, 3E], columns Q | K | V
                e = mod.weight.shape[0]
                mod.weight[:, : 2 * e].mul_(gain)
                mod.bias[: 2 * e].mul_(gain)
    return model


def fp64_copy(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module).double()


def assert_within_reference_error(got, exact, lowp, k: float, what: str = "output"):
    """``got``'s rel-L2 error against ``exact`` (fp64 eager) at most ``k`` times
    ``lowp``'s (the low-precision reference)."""
    err, budget = rel_l2(got, exact), rel_l2(lowp, exact)
    assert err <= k * budget, f"{what}: rel-L2 {err:.3g} > {k} x the low-precision reference's {budget:.3g}"
    return err / budget


# ---------------------------------------------------------------- faults


def _faulty_forward(fault, forward):
    def fwd(q8, k8, v8t, q_scale, k_scale, v_scale, bias, causal, p_mode, out_dtype, diagonal=0, window=0,
            q_documents=None, k_documents=None):
        if fault == "half_scale":
            q_scale = q_scale * 0.5
        elif fault == "mask_ignored":
            bias, causal, diagonal, window, q_documents, k_documents = None, False, 0, 0, None, None
        out, lse, row_ref = forward(q8, k8, v8t, q_scale, k_scale, v_scale, bias, causal, p_mode, out_dtype,
                                    diagonal, window, q_documents, k_documents)
        return (torch.zeros_like(out) if fault == "zero_output" else out), lse, row_ref
    return fwd


def _faulty_backward(fault, backward):
    def bwd(do8, do_scale, delta, q8, k8, v8t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale, bias, row_ref,
            causal, p_mode, out_dtype, diagonal=0, window=0, q_documents=None, k_documents=None):
        if fault == "half_scale":  # the scores and dQ's factor, as the faulty forward's
            q_scale, qe_scale, ke_scale = q_scale * 0.5, qe_scale * 0.5, ke_scale * 0.5
        elif fault == "mask_ignored":
            bias, causal, diagonal, window, q_documents, k_documents = None, False, 0, 0, None, None
        grads = backward(do8, do_scale, delta, q8, k8, v8t, q_scale, k_scale, v_scale, qe, qe_scale, ke, ke_scale,
                         bias, row_ref, causal, p_mode, out_dtype, diagonal, window, q_documents, k_documents)
        return tuple(torch.zeros_like(g) for g in grads) if fault == "zero_output" else grads
    return bwd


@contextlib.contextmanager
def reference_fault(fault: str):
    """The reference path computes attention wrongly, forward and backward alike:
    ``half_scale`` (scores at half the softmax scale), ``mask_ignored`` (no bias, no causal
    structure) or ``zero_output`` (O and the gradients zero)."""
    assert fault in FAULTS, fault
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "attention_forward", _faulty_forward(fault, reference.attention_forward))
        mp.setattr(reference, "attention_backward", _faulty_backward(fault, reference.attention_backward))
        yield


def assert_faults_rejected(run, check, faults=FAULTS):
    """Negative controls: under each fault, ``check(run())`` must fail."""
    for fault in faults:
        with reference_fault(fault):
            result = run()
        with pytest.raises(AssertionError):
            check(result)
