"""Checks of the backward kernels against ``reference.attention_backward``, shared by the
GPU tests (``test_kernels_bwd_gpu.py``) and the CPU run of the Triton kernels under
Triton's interpreter (``test_kernels_interpret.py``).

Operands come from the real pipeline (reference forward for O, LSE and row reference, then
``formats.quantize_do``, ``delta`` and ``formats.backward_operands``), built once on the
CPU; the reference runs on the CPU.  The kernels dump (test-only ``debug`` buffers) the
dK/dV kernel's P operand and dP, and the dQ kernel's dequantized dS; the dK/dV kernel's
dS is rebuilt from its P and dP with the formats' quantization (its float32 steps are the
reference's), which lets the checks be exact where exactness is defined and tight
everywhere else.

Hopper's FP8 tensor cores do not accumulate in full float32: on the H200 an
E4M3 x E5M2 dP tile (K = 64) came out ~1e-4 of max |dP| off the float32 sum, and every
8-bit float product (dP, dV, dQ, dK) is ~1-2e-4 rel-L2 off its float32 value, while the
same products with fp16 operands (exact for these values) are ~2e-7.  The bounds below
are set from those measurements; rule 1 stays exact because scores are INT8 products.

1. P codes are bit-identical to the reference's (integer scores, same formula).  One
   flipped code fails.  "exp" P uses the GPU's exp2 (MUFU, ~2 ulp) against the CPU's, so
   a value on an E4M3 rounding boundary may flip: at most one code in 10^4, one step.
2. dS codes of both kernels (over ``formats.DS_BLOCK_DQ`` and ``ds_block_dk`` blocks) equal
   the reference's wherever the reference's unrounded dS/scale is farther from an E4M3
   rounding midpoint than the dP accumulation error (bounded here by 1e-3 of
   sum |dO| |V|, ~8x the measured error); any other difference fails, so a single
   wrongly computed code fails.  At most 1 % of codes may sit in that band.  dQ's codes
   are the dQ kernel's own (dumped); dK's are rebuilt from the dK/dV kernel's P and dP
   dumps, so its scale blocks are checked by rule 3, through dK itself.
3. dQ, dK, dV equal the products of the kernels' codes with the reference's operands:
   rel-L2 <= 2e-3, max |err| <= 2e-2 max |ref| (measured ~2e-4; a wrong dS scale or
   scale block, a missed or doubled tile, or a wrong GQA head is O(1e-2) rel-L2 or more),
   plus, for dK, what an ulp of dP moves where dP - delta cancels (its codes are rebuilt
   from the rounded dP; the kernel may fuse that rounding away).
4. Against the reference gradients themselves: rel-L2 <= 1e-2 (measured up to 3e-3:
   the accumulation error moves dS codes that sit near midpoints).
Outputs and dumps are poisoned with NaN first; inputs are fresh random data.
"""

from __future__ import annotations

import torch

from fp4_inductor import formats as F
from fp4_inductor import reference as R
from helpers import quantized_operands


def launcher():
    from fp4_inductor.kernels.triton import attention_bwd

    return attention_bwd.attention_backward


def operands(b, h, hkv, nq, nk, d, p_mode, causal, bias_kind=None, dv=None, fused=False, **structure):
    """Backward operands on the CPU, produced as attention.py produces them.  ``dv``: a
    value head dim other than ``d``; ``fused``: the one-kernel backward's (``operands_of``);
    ``structure``: ``diagonal``/``window`` and ``q_documents``/``k_documents``."""
    quantized, bias = quantized_operands(b, h, hkv, nq, nk, d, p_mode, bias_kind, dv=dv)
    return operands_of(quantized, bias, causal, p_mode, fused=fused, **structure)


def operands_of(quantized, bias, causal, p_mode, diagonal=0, window=0, q_documents=None, k_documents=None,
                fused=False):
    """Backward operands from the forward's quantized ones (q8, k8, vt, qs, ks, vs), on
    the CPU, with a random dO; ``fused``: as ``quantized.grad_operands`` makes them for the
    one-kernel backward (dO in E4M3, the forward's codes in place of Qe and Ke)."""
    q8, k8, vt, qs, ks, vs = quantized
    b, h, nq, _ = q8.shape
    dout = torch.randn(b, h, nq, vt.shape[-2])
    out, lse, row_ref = R.attention_forward(q8, k8, vt, qs, ks, vs, bias, causal, p_mode, torch.float32,
                                            diagonal, window, q_documents, k_documents)
    do8, dos = F.quantize_do(dout, lse, row_ref, p_mode, F.E4M3 if fused else F.E5M2)
    delta = (do8.float() * dos[..., None, None] * out).sum(dim=-1)
    qe, qes, ke, kes = (q8, qs, k8, ks) if fused else F.backward_operands(q8, qs, k8, ks)
    return (do8, dos, delta, q8, k8, vt, qs, ks, vs, qe, qes, ke, kes, bias, row_ref)


def run(ops, causal, p_mode, out_dtype=torch.float32, debug=True, device="cuda", diagonal=0, window=0,
        q_documents=None, k_documents=None, dispatch=False):
    """The Triton backward launcher on ``ops`` (moved to ``device``): gradients and the
    debug dumps (P, dP, dS), on the CPU.  ``dispatch``: through ``kernels._backward``
    instead (each direction's Gluon kernel where it takes the call), without dumps."""
    b, h, nq, d = ops[3].shape
    hkv, nk, dv_dim = ops[4].shape[1], ops[4].shape[2], ops[5].shape[-2]
    # Allocated as the op does ([B, N, H, D] storage), poisoned.
    dq = torch.full((b, nq, h, d), float("nan"), dtype=out_dtype, device=device).transpose(1, 2)
    dk = torch.full((b, nk, hkv, d), float("nan"), dtype=out_dtype, device=device).transpose(1, 2)
    dv = torch.full((b, nk, hkv, dv_dim), float("nan"), dtype=out_dtype, device=device).transpose(1, 2)
    dbg = tuple(torch.full((b, h, nq, nk), float("nan"), device=device) for _ in range(3)) if debug else None
    dev = [None if t is None else t.to(device) for t in ops]
    docs = {k: None if t is None else t.to(device) for k, t in (("q_documents", q_documents),
                                                               ("k_documents", k_documents))}
    if dispatch:
        from fp4_inductor import kernels

        assert not debug, "the Gluon kernels take no debug buffers"
        kernels._backward(*dev, causal, p_mode, dq, dk, dv, diagonal, window, docs["q_documents"],
                          docs["k_documents"])
    else:
        launcher()(*dev, causal, p_mode, dq, dk, dv, diagonal=diagonal, window=window, debug=dbg, **docs)
    if device == "cuda":
        torch.cuda.synchronize()
    # Tiles a kernel skips (wholly above the causal diagonal) hold P = dP = dS = 0.
    dumps = tuple(t.nan_to_num(nan=0.0).cpu() for t in dbg) if debug else None
    return (dq.cpu(), dk.cpu(), dv.cpu()), dumps


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _block_amax(x, block):
    """Each element's ``block`` amax of |x|, shaped like x."""
    a = R.ds_blocks(x.abs(), block).amax(dim=(-2, -1))
    return a.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :x.shape[-2], :x.shape[-1]]


def _e4m3(x):
    return x.clamp(-F.E4M3_MAX, F.E4M3_MAX).to(F.E4M3).float()


def _check_ds_codes(ds_kernel, ds_unrounded, noise, block):
    """Rule 2 for dS dequantized over ``block`` scales.  ``noise``: elementwise bound on
    |kernel dS - reference dS| before rounding."""
    t_k, t_u, t_n = (R.ds_blocks(t, block) for t in (ds_kernel, ds_unrounded, noise))
    a_u, a_k = (t.abs().amax(dim=(-2, -1), keepdim=True) for t in (t_u, t_k))
    s_u, s_k = F.ds_scale(a_u), F.ds_scale(a_k)
    # The amax code is 448 but in blocks whose scale is floored (their amax is rounded too).
    amax_ok = ((a_k - a_u).abs() <= 1e-4 * a_u + t_n.amax(dim=(-2, -1), keepdim=True)) | (s_u == F.DS_SCALE_MIN)
    assert amax_ok.all(), "dS block amax off"
    codes_k = _e4m3(t_k / s_k)  # snaps away the rounding of code * scale in the dump
    # The kernel rounded its own dS (within ``noise`` of the reference's) over its own scale.
    c = t_u / s_k
    tol = t_n / s_k + 1e-5 * c.abs()
    ref = _e4m3(t_u / s_u)
    lo, hi = _e4m3(c - tol), _e4m3(c + tol)
    differ = codes_k != ref
    explained = (codes_k >= lo) & (codes_k <= hi)  # rounding is monotone
    bad = differ & ~explained
    assert not bad.any(), f"{int(bad.sum())} dS codes differ from the reference away from a rounding midpoint"
    assert differ.sum() <= 5 + 1e-2 * differ.numel(), f"{int(differ.sum())} dS codes on rounding midpoints"


def check(ops, causal, p_mode, grads, dumps, diagonal=0, window=0, q_documents=None, k_documents=None):
    do8, dos, delta, q8, k8, vt, qs, ks, vs, qe, qes, ke, kes, bias, row_ref = ops
    h, hkv = q8.shape[1], k8.shape[1]
    for g in grads:
        assert not g.isnan().any(), "unwritten or NaN gradient"
    p_k, dp_k, ds_dq = dumps

    # 1. P codes
    documents = None if q_documents is None else (q_documents, k_documents)
    x = R.log2_scores(q8, k8, qs, ks, bias, causal, slice(0, k8.shape[-2]), diagonal=diagonal, window=window,
                      documents=documents)
    p_ref = R._probability(x, row_ref[..., None], p_mode)
    flips = p_k != p_ref
    if p_mode == "exp":
        assert flips.sum() <= 1e-4 * flips.numel(), f"{int(flips.sum())} P codes differ"
        step = (p_k[flips] - p_ref[flips]).abs()
        assert (step <= 0.15 * torch.maximum(p_k[flips], p_ref[flips]) + 2.0**-9).all(), "an exp P code moved by more than one step"
    else:
        assert not flips.any(), f"{int(flips.sum())} P codes differ from the reference"

    # 2. dS codes of both kernels; the dK/dV kernel's from its own P and dP
    do = do8.float() * dos[..., None, None]
    v = R._heads(vt.transpose(-1, -2).float() * vs[..., None, None], h)
    dp = do @ v.transpose(-1, -2)
    # From the kernel's own P: equal to the reference's but for exp's allowed flips (rule 1).
    ds_unrounded = p_k * (dp - delta[..., None])
    noise = p_k * (1e-3 * (do.abs() @ v.abs().transpose(-1, -2)) + 1e-5 * delta.abs()[..., None])
    ds_dk_unrounded = p_k * (dp_k - delta[..., None])
    dk_block = F.ds_block_dk(q8.shape[-1])
    ds_dk = R.quantize_ds_blocks(ds_dk_unrounded, dk_block)
    _check_ds_codes(ds_dq, ds_unrounded, noise, F.DS_BLOCK_DQ)
    _check_ds_codes(ds_dk, ds_unrounded, noise, dk_block)

    # 3. gradients = products of what the kernels multiplied
    kd = R._heads(F.dequantize_blockwise(ke, kes), h)
    qd = F.dequantize_blockwise(qe, qes)
    expect = (ds_dq @ kd, R._group_sum(ds_dk.transpose(-1, -2) @ qd, hkv),
              R._group_sum(p_k.transpose(-1, -2) @ do, hkv))
    # dK's codes are rebuilt from the dP dump, rounded to float32; the kernel may fuse that
    # rounding away (dP's scaling and the subtraction of delta in one FMA).  Where dP - delta
    # cancels (one key, say) that ulp moves dS, and its block's amax scale with it.
    fused = p_k * dp_k.abs() * 2.0**-23
    scale_moved = _block_amax(fused, dk_block) / _block_amax(ds_dk_unrounded, dk_block).clamp_min(1e-30)
    ds_moved = fused + ds_dk.abs() * scale_moved
    carried = (torch.zeros(()), R._group_sum(ds_moved.transpose(-1, -2) @ qd.abs(), hkv), torch.zeros(()))
    for name, got, exp, c in zip("dq dk dv".split(), grads, expect, carried):
        err = (got.double() - exp.double()).abs()
        rel, c = rel_l2(got, exp), c.double()
        assert err.norm() <= 2e-3 * exp.double().norm() + c.norm(), \
            f"{name}: rel-L2 {rel:.2e} against the products of the kernel's own codes"
        assert (err <= 2e-2 * exp.abs().max() + c).all(), \
            f"{name}: max error {err.max() / exp.abs().max().clamp_min(1e-30):.2e} of max |ref|"

    # 4. the reference itself
    # (dS that is zero up to rounding, e.g. one key, gives gradients made of that noise:
    # the bound adds what the dS noise bound carries into each gradient.)
    ref = R.attention_backward(*ops, causal, p_mode, torch.float32, diagonal, window, q_documents, k_documents)
    carried = (noise @ kd.abs(), R._group_sum(noise.transpose(-1, -2) @ qd.abs(), hkv), torch.zeros(()))
    for name, got, r, c in zip("dq dk dv".split(), grads, ref, carried):
        err = (got.double() - r.double()).norm().item()
        assert err <= 1e-2 * r.double().norm().item() + c.double().norm().item(), \
            f"{name}: rel-L2 {rel_l2(got, r):.2e} against the reference"


