"""The Triton quantization kernel against the formats code run on the CPU.

The CPU is the reference because its float32 division is IEEE everywhere (eager CUDA
divides by a Python scalar as a multiplication by its reciprocal).  Q and V go through the
same float32 operations in the same order (IEEE division, round to nearest even), so
their codes and scales must be bit-identical.  K's smoothing
mean is summed in another order, so a K code may move by one step where its scaled value
lies within float32 rounding of a half-integer: at most one code in 10^4, never more than
one step, scales within 1e-6.  Outputs come from memory the test filled with 0xFF first.
"""

from __future__ import annotations

import pytest
import torch

from fp4_inductor import formats as F
from helpers import bits

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


def _poison_allocator():
    """Fill the caching allocator's free memory with 0xFF so that unwritten outputs show."""
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").fill_(255)
    del block


def _launch(q, k, v, sm_scale):
    from fp4_inductor.kernels.triton.quantize import quantize_inputs

    _poison_allocator()
    return quantize_inputs(q, k, v, sm_scale)


def _inputs(b, h, hkv, nq, nk, d, dtype, layout):
    def make(heads, n):
        x = torch.randn(b, n, heads, d, device="cuda", dtype=dtype) * 3 + 0.5  # a channel offset to smooth
        return x.transpose(1, 2) if layout == "bnhd" else x.transpose(1, 2).contiguous()

    return make(h, nq), make(hkv, nk), make(hkv, nk)


def _reference(q, k, v, sm_scale):
    """formats on the CPU, moved back to the GPU."""
    return tuple(t.cuda() for t in F.quantize_inputs(q.cpu(), k.cpu(), v.cpu(), sm_scale, "fp8"))


def _check_k(k8, k_scale, k8_ref, k_scale_ref):
    torch.testing.assert_close(k_scale, k_scale_ref, rtol=1e-6, atol=0)
    diff = (k8.int() - k8_ref.int()).abs()
    assert diff.max().item() <= 1
    assert (diff > 0).float().mean().item() <= 1e-4


SHAPES = [(1, 1, 1, 1, 1), (2, 4, 2, 113, 203), (1, 8, 1, 799, 1023), (2, 4, 4, 4224, 4224), (1, 2, 2, 128, 65536)]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}kv{}q{}k{}".format(*s))
def test_matches_formats(shape, d, layout):
    q, k, v = _inputs(*shape, d, torch.bfloat16, layout)
    sm_scale = d ** -0.5
    q8, k8, vt, qs, ks, vs = _launch(q, k, v, sm_scale)
    q8_ref, k8_ref, vt_ref, qs_ref, ks_ref, vs_ref = _reference(q, k, v, sm_scale)
    assert torch.equal(q8, q8_ref) and torch.equal(qs, qs_ref)
    assert torch.equal(bits(vt), bits(vt_ref)) and torch.equal(vs, vs_ref)
    _check_k(k8, ks, k8_ref, ks_ref)


@pytest.mark.parametrize("d,dv", [(32, 32), (40, 40), (80, 80), (96, 96), (160, 160), (256, 256), (192, 128)])
def test_head_dims(d, dv):
    """Head dims that are not powers of two run in padded tiles (masked channels); D_v of its own."""
    q, k, _ = _inputs(2, 4, 2, 113, 203, d, torch.bfloat16, "bnhd")
    v = torch.randn(2, 2, 203, dv, device="cuda", dtype=torch.bfloat16)
    q8, k8, vt, qs, ks, vs = _launch(q, k, v, d ** -0.5)
    q8_ref, k8_ref, vt_ref, qs_ref, ks_ref, vs_ref = _reference(q, k, v, d ** -0.5)
    assert torch.equal(q8, q8_ref) and torch.equal(qs, qs_ref)
    assert torch.equal(bits(vt), bits(vt_ref)) and torch.equal(vs, vs_ref)
    _check_k(k8, ks, k8_ref, ks_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_input_dtypes(dtype):
    q, k, v = _inputs(2, 4, 2, 300, 300, 128, dtype, "bnhd")
    q8, k8, vt, qs, ks, vs = _launch(q, k, v, 0.09)
    q8_ref, k8_ref, vt_ref, qs_ref, ks_ref, vs_ref = _reference(q, k, v, 0.09)
    assert torch.equal(q8, q8_ref) and torch.equal(qs, qs_ref) and torch.equal(bits(vt), bits(vt_ref))
    _check_k(k8, ks, k8_ref, ks_ref)


def test_nan_and_zero_blocks_like_formats():
    q, k, v = _inputs(1, 2, 2, 300, 300, 64, torch.bfloat16, "bhnd")
    q[0, 0, 5, 3] = float("nan")
    k[0, 1, 7, 0] = float("nan")
    v[0, 0, 250, 9] = float("nan")
    q[0, 1, 9] = 0  # an all-zero row gets scale 1
    q8, k8, vt, qs, ks, vs = _launch(q, k, v, 0.125)
    q8_ref, k8_ref, vt_ref, qs_ref, ks_ref, vs_ref = _reference(q, k, v, 0.125)
    torch.testing.assert_close(qs, qs_ref, rtol=0, atol=0, equal_nan=True)
    assert qs[0, 1, 9].item() == 1.0
    torch.testing.assert_close(ks, ks_ref, rtol=1e-6, atol=0, equal_nan=True)
    assert ks[0, 1, 0].isnan() and not ks[0, 0].isnan().any()  # the NaN key's block (and the mean's)
    assert bool((ks[..., -1] == 1).all())  # formats.scale_blocks: the spare block
    # V's scale skips the NaN, which becomes V's NaN code (formats.finite_amax).
    assert not vs.isnan().any() and vt[0, 0, 9, 250].float().isnan()
    assert torch.equal(q8[0, 1], q8_ref[0, 1])


def test_op_dispatches_to_kernel_under_compile():
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _inputs(2, 4, 2, 256, 256, 128, torch.bfloat16, "bnhd")
    fn = torch.compile(lambda q, k, v: torch.ops.fp4attn.quantize(q, k, v, 0.1, "fp8"), fullgraph=True)
    fn(q, k, v)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = fn(q, k, v)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert "_quantize" in names and "_stats" in names
    assert torch.equal(got[0], F.quantize_q(q.cpu(), 0.1)[0].cuda())
