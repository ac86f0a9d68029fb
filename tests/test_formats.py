"""The quantization formats themselves: exact codes, monotonicity, clamping, scales,
and the accuracy each format reaches against an fp64 reference."""

import math

import pytest
import torch

from fp4_inductor import formats as F
from fp4_inductor import reference as R
from helpers import cosine, rel_l2


def test_direct_p_codes_exact_values():
    m = torch.zeros(1, 1)
    x = torch.tensor([[0.0, -1.0, -0.5, -2.0, -14.0, -15.0, -20.0, 0.75, 1.0]])
    codes = F.direct_p_codes(x, m)
    # code = 8 (x - m) + 120, rounded half-even, clamped to [0, 126]
    assert codes.tolist() == [[120, 112, 116, 104, 8, 0, 0, 126, 126]]
    # 120 is 2**8 (the row maximum lifted by 256); 112 is 2**7; 116 is 1.5 * 2**7
    values = F.e4m3_value(codes)
    assert values[0, :4].tolist() == [256.0, 128.0, 192.0, 64.0]
    assert values[0, 4].item() == 2.0**-6  # code 8: smallest normal E4M3
    assert values[0, -1].item() == 448.0  # code 126: largest finite E4M3, never NaN


def test_direct_p_rounds_half_to_even_and_shifts_by_octaves():
    m = torch.zeros(1, 1)
    x = torch.tensor([[-1 / 16, -3 / 16]])  # 8x + 120 = 119.5, 118.5
    assert F.direct_p_codes(x, m).tolist() == [[120, 118]]
    # An integer reference shift moves every code by exactly 8 per octave.
    y = torch.randn(64, 256) * 4
    a = F.direct_p_codes(y - 2.0, torch.full((64, 1), 18.0))
    b = F.direct_p_codes(y, torch.full((64, 1), 20.0))
    assert torch.equal(a, b)


def test_direct_p_monotone_and_within_piecewise_linear_error():
    x = torch.linspace(-14.0, 0.0, 20001)[None]
    m = torch.zeros(1, 1)
    values = F.e4m3_value(F.direct_p_codes(x, m))
    assert bool((values[0, 1:] >= values[0, :-1]).all())
    exact = torch.exp2(x + 8.0)
    ratio = values / exact
    # Piecewise-linear 1 + f >= 2**f (at most +6.15 %), times half a code of rounding.
    assert ratio.max().item() <= 1.0615 * 2 ** (1 / 16) + 1e-6
    assert ratio.min().item() >= 2 ** (-1 / 16) - 1e-6


def test_exp_mode_is_nearest_e4m3_of_exp2():
    x = -torch.rand(8, 128) * 10
    m = torch.zeros(8, 1)
    p = F.probability_operand(x, m, "exp")
    exact = torch.exp2(x + 8.0)
    e4m3_grid = F.e4m3_value(torch.arange(0, 127, dtype=torch.float32))
    nearest = e4m3_grid[(exact[..., None] - e4m3_grid).abs().argmin(dim=-1)]
    assert torch.equal(p, nearest)


def test_e2m1_round_values_and_boundaries():
    u = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.74, 0.76, 1.3, 1.8, 2.4, 2.6, 3.6, 4.9, 5.0, 5.1, 100.0])
    assert F.e2m1_round(u).tolist() == [0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 4.0, 6.0, 6.0]
    assert math.isnan(F.e2m1_round(torch.tensor([float("nan")])).item())


def test_fp4_probability_codes_are_e2m1_times_block_power_of_two():
    x = -torch.rand(4, 1, 128) * 12
    m = torch.zeros(4, 1, 1)
    p = F.fp4_probability(x, m)
    blocks = p.unflatten(-1, (-1, F.FP4_BLOCK))
    top = blocks.amax(dim=-1, keepdim=True)
    exponent = torch.floor(torch.log2(top / 4.0))  # the block's largest payload is 4 or 6
    payload = blocks / torch.exp2(exponent)
    allowed = torch.tensor(F.E2M1_VALUES)
    live = top > 2.0**-9  # blocks still above the container's subnormal range
    on_grid = ((payload[..., None] - allowed).abs().amin(dim=-1) == 0) | ~live
    assert bool(on_grid.all())
    # Invariant under an integer reference shift (codes and block exponents move together).
    assert torch.equal(F.fp4_probability(x + 3.0, m + 3.0), p)


def test_mxfp4_values_are_exact_e2m1_times_block_scale():
    x = torch.randn(2, 3, 96, 16)
    r = F.mxfp4_round(x).unflatten(-2, (-1, F.FP4_BLOCK))
    scale = torch.exp2(torch.ceil(torch.log2(x.unflatten(-2, (-1, F.FP4_BLOCK)).abs().amax(-2, keepdim=True) / 6.0)))
    payload = (r / scale).abs()
    allowed = torch.tensor(F.E2M1_VALUES)
    assert ((payload[..., None] - allowed).abs().amin(-1) == 0).all()
    assert payload.amax().item() <= 6.0


def test_int8_q_per_token_scale_and_rounding():
    q = torch.randn(2, 3, 50, 64)
    q8, scale = F.quantize_q(q, 0.125)
    assert q8.dtype == torch.int8 and scale.shape == (2, 3, 50)
    assert torch.allclose(scale, (q * 0.125).abs().amax(-1) / 127.0)
    assert q8.abs().amax(-1).eq(127).all()  # each row's maximum uses the full range
    err = (F.dequantize_q(q8, scale) - q * 0.125).abs()
    assert bool((err <= scale[..., None] / 2 * (1 + 1e-4)).all())  # half a step, plus float32 rounding of x / scale


def test_int8_k_is_smoothed_with_one_scale_per_block():
    k = torch.randn(2, 2, 300, 64) + 5.0 * torch.randn(1, 1, 1, 64)  # channel bias
    k8, scale = F.quantize_k(k)
    assert scale.shape == (2, 2, F.scale_blocks(300)) == (2, 2, 4)  # three blocks and the spare
    assert bool((scale[..., -1] == 1).all())
    # The mean of 128 tokens spread over the 300 (one pass over K in the kernel).
    samples = [i * 300 // 128 for i in range(128)]
    assert samples[:4] == [0, 2, 4, 7] and samples[-1] == 297
    smoothed = k - k[..., samples, :].mean(dim=-2, keepdim=True)
    err = (F.dequantize_k(k8, scale) - smoothed).abs()
    assert bool((err <= F.expand_block_scale(scale, 300)[..., None] / 2 * (1 + 1e-4)).all())  # half a step, plus float32 rounding of x / scale
    # Smoothing shifts each score row by a constant: softmax is unchanged.
    q = torch.randn(2, 2, 7, 64)
    a = torch.softmax(q @ k.mT, -1)
    b = torch.softmax(q @ smoothed.mT, -1)
    assert torch.allclose(a, b, atol=1e-5)
    # Up to 128 tokens, the mean of all of them.
    short = k[..., :100, :]
    torch.testing.assert_close(F.smooth_k(short), short - short.mean(dim=-2, keepdim=True))


def test_e4m3_v_one_scale_per_head_stored_k_major():
    v = torch.randn(2, 2, 70, 64)
    v8t, scale = F.quantize_v(v, "fp8")
    assert v8t.shape == (2, 2, 64, 70) and v8t.dtype == F.E4M3 and v8t.is_contiguous()
    assert scale.shape == (2, 2)
    assert torch.allclose(v8t.float().abs().amax(dim=(-2, -1)), torch.full((2, 2), 448.0))
    back = v8t.float().transpose(-1, -2) * scale[..., None, None]
    assert rel_l2(back, v) < 0.03


def test_fp4_v_container_holds_mxfp4_values_exactly():
    v = torch.randn(1, 2, 64, 32)
    v8t, scale = F.quantize_v(v, "fp4")
    back = v8t.float().transpose(-1, -2) * scale[..., None, None]
    assert torch.equal(back, F.mxfp4_round(v))


def test_saturation_and_nan_propagation_in_casts():
    x = torch.randn(1, 1, 128, 64)
    x[0, 0, 3, 5] = float("nan")
    codes, scale = F.quantize_blockwise(x)
    assert torch.isnan(scale[..., 0]).all()  # a NaN block's scale is NaN: the NaN reaches the output
    assert bool((scale[..., 1] == 1).all())  # the spare block (formats.scale_blocks)
    big = torch.full((1, 1, 4, 64), 1e30)
    codes, scale = F.quantize_blockwise(big, F.E5M2)
    assert torch.isfinite(codes.float()).all() and codes.float().amax().item() == F.E5M2_MAX


def test_ds_scale_is_floored_so_its_inverse_stays_finite():
    ds = torch.randn(3, 64, 64)
    ds[0] = 0.0  # a fully masked tile
    ds[1] *= 1e-40  # subnormal values: amax / 448 is below float32's smallest normal
    ds[1, 0, :7] = 0.0
    codes, scale = F.quantize_ds(ds)
    assert scale[0].item() == scale[1].item() == F.DS_SCALE_MIN
    assert torch.isfinite(1.0 / scale).all() and torch.isfinite(codes).all()
    assert torch.equal(codes[0], torch.zeros(64, 64)) and torch.equal(codes[1, 0, :7], torch.zeros(7))
    # The floored tile is still rounded to E4M3 (in subnormal float32 units of 2**-126).
    assert ((codes[1] * scale[1] - ds[1]).abs() <= 2**-4 * ds[1].abs() + 2**-135).all()
    assert scale[2].item() == pytest.approx(ds[2].abs().max().item() / F.E4M3_MAX, rel=1e-6)
    ds[2, 5, 5] = float("nan")
    assert torch.isnan(F.quantize_ds(ds)[1][2]).all()  # a NaN tile's scale carries the NaN


@pytest.mark.parametrize("p_mode", ["direct", "exp"])
def test_backward_row_factor_folds_normalisation(p_mode):
    """Probabilities written against the integer row reference (2**(x - R + lift), as the
    kernels' codes represent them) times the factor are the normalised softmax."""
    x = torch.randn(6, 3000, dtype=torch.float64) * 3  # log2 scores
    row_ref = torch.ceil(x.amax(dim=-1))
    lse = torch.logsumexp(x * math.log(2), dim=-1)
    unnormalised = torch.exp2(x - row_ref[:, None] + F.p_lift(p_mode))
    p = unnormalised * F.backward_row_factor(lse, row_ref, p_mode)[:, None]
    assert torch.allclose(p, torch.softmax(x * math.log(2), dim=-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_accuracy_against_fp64(causal):
    """Forward rel-L2 of each format on Gaussian inputs (D=128, N=512).  Measured on CPU:
    fp8 direct 0.043, fp8 exp 0.039, fp4 0.44 (the paper's affine FP4 classifier; exact
    E2M1 rounding of 2**x would give 0.17).  Bounds leave room for seed variation."""
    q, k, v = (torch.randn(1, 4, 512, 128) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    sm = 1 / math.sqrt(128)
    bounds = {("fp8", "direct"): 0.05, ("fp8", "exp"): 0.046, ("fp4", "fp4"): 0.5}
    for (fmt, p_mode), bound in bounds.items():
        out = R.attention_forward(*F.quantize_inputs(q, k, v, sm, fmt), None, causal, p_mode, torch.float32)[0]
        err = rel_l2(out, ref)
        assert err < bound, (fmt, p_mode, err)
        assert err > 0.2 * bound  # a quantized path that is exact would mean quantization was skipped
    assert cosine(out, ref) > 0.85
