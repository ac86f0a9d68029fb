"""``fp4_inductor.scaled_dot_product_attention`` against SDPA's contract.

The cases are those PyTorch's own SDPA tests exercise (the OpInfo samples of
``scaled_dot_product_attention`` and test/test_transformers.py): 3-D and 4-D inputs and
queries that broadcast, masks of every broadcastable rank (boolean and additive),
causal with Nq != Nk (and ``torch.nn.attention.bias``'s causal variants), scale, GQA,
dtypes, empty tensors and their gradients, fully masked rows, dropout, autocast and the
errors torch raises.  Each runs under every policy: ``never`` and ``auto`` (on a CPU) must
be SDPA itself; ``always`` runs the reference emulation of the kernels wherever a case is
supported, and its error against float64 SDPA is bounded by a multiple of a same-precision
reference's (``attention_checks.lowp_sdpa``); elsewhere it must be SDPA too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from torch.profiler import ProfilerActivity, profile

import fp4_inductor
from attention_checks import assert_faults_rejected, assert_within_reference_error, lowp_sdpa
from helpers import op_calls, rel_l2

POLICIES = ("always", "never", "auto")
# Our error over the same-precision reference's: 0.93-1.45 measured over the low-precision
# cases and 12 seeds (outputs and gradients); a halved scale or an ignored mask gives 5.4-33.
K_OUT, K_GRAD = 2.5, 2.5

B, H, NQ, NK, D = 2, 4, 24, 40, 32


def _tensor(shape, dtype, grad):
    return torch.randn(shape, dtype=dtype).requires_grad_(grad)


def _mask(kind, shape):
    """A boolean mask keeping about 70 % of the scores (each query at least one key) or a
    Gaussian additive one."""
    if kind == "bool":
        keep = torch.rand(shape) > 0.3
        keep[..., :1] = True
        return keep
    return torch.randn(shape) * 2


# name: (query shape, key/value shape, keyword arguments; "mask": (kind, shape)), and
# whether "always" takes the low-precision path.
CASES = {
    "4d": ((B, H, NQ, D), (B, H, NK, D), {}, True),
    "3d": ((B, NQ, D), (B, NK, D), {}, True),
    "opinfo_shapes": ((4, 4, 3, D), (4, 4, 6, D), {}, True),  # the OpInfo's lengths, a supported head dim
    "one_key": ((B, H, NQ, D), (B, H, 1, D), {}, True),
    "causal_square": ((B, H, NK, D), (B, H, NK, D), dict(is_causal=True), True),
    "causal_fewer_queries": ((B, H, NQ, D), (B, H, NK, D), dict(is_causal=True), True),
    "causal_more_queries": ((B, H, NK, D), (B, H, NQ, D), dict(is_causal=True), True),
    "scale": ((B, H, NQ, D), (B, H, NK, D), dict(scale=0.4), True),
    "negative_scale": ((B, H, NQ, D), (B, H, NK, D), dict(scale=-0.3), True),
    "gqa": ((B, H, NQ, D), (B, 2, NK, D), dict(enable_gqa=True), True),
    "mqa_causal": ((B, H, NQ, D), (B, 1, NK, D), dict(enable_gqa=True, is_causal=True), True),
    "value_head_dim": ((B, H, NQ, D), (B, H, NK, D), dict(v_dim=64), True),
    "bool_mask_2d": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("bool", (NQ, NK))), True),
    "bool_mask_3d": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("bool", (H, NQ, NK))), True),
    "bool_mask_4d": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("bool", (B, H, NQ, NK))), True),
    "bool_key_padding": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("bool", (B, 1, 1, NK))), True),
    "float_mask_2d": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("float", (NQ, NK))), True),
    "float_mask_3d_inputs": ((B, NQ, D), (B, NK, D), dict(mask=("float", (B, NQ, NK))), True),
    "float_mask_4d": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("float", (B, 1, NQ, NK))), True),
    "float_mask_per_head": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("float", (1, H, 1, NK))), True),
    "gqa_mask": ((B, H, NQ, D), (B, 2, NK, D), dict(enable_gqa=True, mask=("bool", (B, 1, NQ, NK))), True),
    # torch's own fallbacks: a head dim the ops do not take (the OpInfo's 8), float64,
    # a query broadcast over the batch (the OpInfo's broadcast sample)
    "head_dim_8": ((4, 4, 3, 8), (4, 4, 6, 8), {}, False),
    "float64": ((B, H, NQ, D), (B, H, NK, D), dict(dtype=torch.float64), False),
    "query_broadcast": ((H, NQ, D), (B, H, NK, D), {}, False),
    "query_batch_broadcast": ((1, H, NQ, D), (B, H, NK, D), {}, False),
    "mask_and_is_causal": ((B, H, NQ, D), (B, H, NK, D), dict(mask=("bool", (NQ, NK)), is_causal=True), False),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _inputs(q_shape, kv_shape, kwargs, dtype, grad):
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", dtype)
    v_shape = (*kv_shape[:-1], kwargs.pop("v_dim", kv_shape[-1]))
    q, k, v = (_tensor(s, dtype, grad) for s in (q_shape, kv_shape, v_shape))
    if "mask" in kwargs:
        kind, shape = kwargs.pop("mask")
        mask = _mask(kind, shape)
        kwargs["attn_mask"] = mask if kind == "bool" else mask.to(dtype)
    return (q, k, v), kwargs


def _ops_run(fn):
    """``fn()`` and how often ``fp4attn::fwd`` and ``fp4attn::bwd`` ran in it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    names = [e.name for e in prof.events()]
    return result, names.count("fp4attn::fwd"), names.count("fp4attn::bwd")


def _forward_backward(attention, inputs, kwargs, grad_out):
    """The output and, with ``grad_out``, the gradients of the inputs (zeros for one the
    output does not depend on: K and V without a query)."""
    out = attention(*inputs, **kwargs)
    if grad_out is None:
        return out, None
    return out, torch.autograd.grad(out, inputs, grad_out.to(out.dtype), allow_unused=True, materialize_grads=True)


def _float64(inputs, kwargs):
    inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs = dict(kwargs, attn_mask=mask.double())
    return inputs, kwargs


def _check(inputs, kwargs, policy, lowp: bool):
    """The drop-in against SDPA on the same call: shapes and dtypes always; values equal
    where SDPA runs, within ``K_OUT``/``K_GRAD`` times the same-precision reference's
    error where the low-precision path does (which must have run)."""
    grad = inputs[0].requires_grad
    torch_out = F.scaled_dot_product_attention(*inputs, **kwargs)
    grad_out = torch.randn_like(torch_out) if grad else None
    torch_grads = torch.autograd.grad(torch_out, inputs, grad_out) if grad else None
    with fp4_inductor.configure(policy=policy):
        (out, grads), fwd, bwd = _ops_run(
            lambda: _forward_backward(fp4_inductor.scaled_dot_product_attention, inputs, kwargs, grad_out))
    assert (out.shape, out.dtype) == (torch_out.shape, torch_out.dtype)
    for g, t in zip(grads or (), torch_grads or ()):
        assert (g.shape, g.dtype) == (t.shape, t.dtype)
    low = lowp and policy == "always"
    assert (fwd, bwd) == ((1, int(grad)) if low else (0, 0))
    if not low:
        torch.testing.assert_close(out, torch_out, rtol=0, atol=0)
        for g, t in zip(grads or (), torch_grads or ()):
            torch.testing.assert_close(g, t, rtol=0, atol=0)
        return
    inputs64, kwargs64 = _float64(inputs, kwargs)
    grad64 = grad_out.double() if grad else None
    exact, exact_grads = _forward_backward(F.scaled_dot_product_attention, inputs64, kwargs64, grad64)
    ref, ref_grads = _forward_backward(lowp_sdpa, inputs64, kwargs64, grad64)
    assert_within_reference_error(out, exact, ref, K_OUT)
    for g, e, r, name in zip(grads or (), exact_grads or (), ref_grads or (), "qkv"):
        assert_within_reference_error(g, e, r, K_GRAD, f"d{name}")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_matches_sdpa(case, policy):
    q_shape, kv_shape, kwargs, lowp = CASES[case]
    inputs, kwargs = _inputs(q_shape, kv_shape, kwargs, torch.bfloat16, grad=False)
    _check(inputs, kwargs, policy, lowp)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", ["4d", "3d", "causal_fewer_queries", "causal_more_queries", "gqa", "scale",
                                  "float_mask_2d", "bool_key_padding", "value_head_dim", "head_dim_8"])
def test_gradients_match_sdpa(case, policy):
    q_shape, kv_shape, kwargs, lowp = CASES[case]
    inputs, kwargs = _inputs(q_shape, kv_shape, kwargs, torch.bfloat16, grad=True)
    _check(inputs, kwargs, policy, lowp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", POLICIES)
def test_dtypes(dtype, policy):
    inputs, kwargs = _inputs((B, H, NQ, D), (B, H, NK, D), dict(mask=("float", (NQ, NK))), dtype, grad=True)
    _check(inputs, kwargs, policy, lowp=True)


def test_the_bound_rejects_wrong_attention():
    """Negative control: the bound used above fails attention with a halved scale, an
    ignored mask or zeros (faults in the reference path the "always" cases run)."""
    inputs, kwargs = _inputs((B, H, NQ, D), (B, H, NK, D), dict(mask=("bool", (B, 1, NQ, NK))), torch.bfloat16,
                             grad=False)
    inputs64, kwargs64 = _float64(inputs, kwargs)
    exact = F.scaled_dot_product_attention(*inputs64, **kwargs64)
    ref = lowp_sdpa(*inputs64, **kwargs64)

    def run():
        with fp4_inductor.configure(policy="always"):
            return fp4_inductor.scaled_dot_product_attention(*inputs, **kwargs)

    assert_within_reference_error(run(), exact, ref, K_OUT)
    assert_faults_rejected(run, lambda out: assert_within_reference_error(out, exact, ref, K_OUT))


# ---------------------------------------------------------------- causal variants


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("nq, nk", [(NQ, NK), (NK, NQ), (NK, NK)])
def test_causal_bias_variants(variant, nq, nk, policy):
    """``torch.nn.attention.bias``'s ``CausalBias`` masks: SDPA's causal structure with its
    top-left or bottom-right diagonal (rows with no key where Nq > Nk get zeros)."""
    bias = (causal_upper_left if variant == "upper_left" else causal_lower_right)(nq, nk)
    inputs, _ = _inputs((B, H, nq, D), (B, H, nk, D), {}, torch.bfloat16, grad=True)
    grad_out = torch.randn(B, H, nq, D)
    torch_out, torch_grads = _forward_backward(F.scaled_dot_product_attention, inputs, dict(attn_mask=bias),
                                               grad_out)
    with fp4_inductor.configure(policy=policy):
        (out, grads), fwd, bwd = _ops_run(lambda: _forward_backward(
            fp4_inductor.scaled_dot_product_attention, inputs, dict(attn_mask=bias), grad_out))
    assert type(out) is torch.Tensor and (out.shape, out.dtype) == (torch_out.shape, torch_out.dtype)
    # the same structure as a boolean mask is what the references read
    keep = bias._materialize()
    if policy != "always":
        assert (fwd, bwd) == (0, 0)
        torch.testing.assert_close(out, torch_out, rtol=0, atol=0)
        for g, t in zip(grads, torch_grads):
            torch.testing.assert_close(g, t, rtol=0, atol=0)
        return
    assert (fwd, bwd) == (1, 1)
    inputs64, _ = _float64(inputs, {})
    exact, exact_grads = _forward_backward(F.scaled_dot_product_attention, inputs64, dict(attn_mask=keep),
                                           grad_out.double())
    ref, ref_grads = _forward_backward(lowp_sdpa, inputs64, dict(attn_mask=keep), grad_out.double())
    assert_within_reference_error(out, exact, ref, K_OUT)
    for g, e, r in zip(grads, exact_grads, ref_grads):
        assert_within_reference_error(g, e, r, K_GRAD, "gradient")


# ---------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("empty", ["keys", "queries", "batch"])
@pytest.mark.parametrize("kwargs", [{}, dict(is_causal=True), dict(mask="bool"), dict(mask="float")],
                         ids=["plain", "causal", "bool_mask", "float_mask"])
def test_empty_inputs_and_their_gradients(empty, kwargs, policy):
    """No key: zeros (SDPA's answer, causal too) and zero gradients; no query or no batch
    row: an empty output, and zero gradients for K and V."""
    b, nq, nk = (0 if empty == "batch" else B), (0 if empty == "queries" else NQ), (0 if empty == "keys" else NK)
    kwargs = dict(kwargs)
    if "mask" in kwargs:
        kwargs["mask"] = (kwargs["mask"], (b, 1, nq, nk))
    inputs, kwargs = _inputs((b, H, nq, D), (b, H, nk, D), kwargs, torch.bfloat16, grad=True)
    grad_out = torch.randn(b, H, nq, D)
    torch_out, torch_grads = _forward_backward(F.scaled_dot_product_attention, inputs, kwargs, grad_out)
    with fp4_inductor.configure(policy=policy):
        (out, grads), fwd, _ = _ops_run(lambda: _forward_backward(
            fp4_inductor.scaled_dot_product_attention, inputs, kwargs, grad_out))
    assert fwd == (policy == "always")
    torch.testing.assert_close(out, torch_out, rtol=0, atol=0)
    for g, t in zip(grads, torch_grads):
        torch.testing.assert_close(g, t, rtol=0, atol=0)


@pytest.mark.parametrize("empty", ["keys", "queries"])
def test_empty_inputs_compiled(empty):
    """The same through ``backend="fp4attn"`` (the op itself, one graph)."""
    nq, nk = (0, NK) if empty == "queries" else (NQ, 0)
    inputs, _ = _inputs((B, H, nq, D), (B, H, nk, D), {}, torch.bfloat16, grad=True)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend="fp4attn",
                             fullgraph=True)
    with fp4_inductor.configure(policy="always"):
        (out, grads), calls = op_calls(_forward_backward, compiled, inputs, {}, torch.randn(B, H, nq, D))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 and calls == {"fwd": 1, "bwd": 1}
    assert out.shape == (B, H, nq, D) and not out.any()
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and not g.any()


# ---------------------------------------------------------------- fully masked rows


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fill", ["bool", "-inf", "finfo.min"])
def test_fully_masked_rows(fill, policy):
    """A query row with no visible key: zeros for a boolean or -inf mask (SDPA's safe
    softmax), the mean of V for a finite fill (softmax over equal scores); the other rows
    as ever."""
    inputs, _ = _inputs((B, H, NQ, D), (B, H, NK, D), {}, torch.bfloat16, grad=False)
    keep = _mask("bool", (B, 1, NQ, NK))
    dead = torch.rand(B, 1, NQ, 1) < 0.25
    keep = keep & ~dead
    if fill == "bool":
        mask = keep
    else:
        value = -math.inf if fill == "-inf" else torch.finfo(torch.bfloat16).min
        mask = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, value)
    torch_out = F.scaled_dot_product_attention(*inputs, attn_mask=mask)
    with fp4_inductor.configure(policy=policy):
        out = fp4_inductor.scaled_dot_product_attention(*inputs, attn_mask=mask)
    rows = dead.expand(B, H, NQ, 1).squeeze(-1)
    if policy == "always":
        expected = torch.zeros_like(out[rows]) if fill != "finfo.min" else torch_out[rows]
        torch.testing.assert_close(out[rows], expected, rtol=0.02, atol=0.02)  # V's mean in E4M3 where finite
        inputs64, _ = _float64(inputs, {})
        keep64 = dict(attn_mask=keep)
        assert_within_reference_error(out[~rows], F.scaled_dot_product_attention(*inputs64, **keep64)[~rows],
                                      lowp_sdpa(*inputs64, **keep64)[~rows], K_OUT)
    else:
        torch.testing.assert_close(out, torch_out, rtol=0, atol=0)


# ---------------------------------------------------------------- dropout, autocast


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_is_sdpa_s_own(policy):
    """dropout_p > 0 is left to SDPA: the same random draws give the same output."""
    inputs, _ = _inputs((B, H, NQ, D), (B, H, NK, D), {}, torch.bfloat16, grad=True)
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    expected = F.scaled_dot_product_attention(*inputs, dropout_p=0.5)
    with fp4_inductor.configure(policy=policy):
        torch.manual_seed(seed)
        out, fwd, _ = _ops_run(lambda: fp4_inductor.scaled_dot_product_attention(*inputs, dropout_p=0.5))
    assert fwd == 0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
def test_autocast(input_dtype, autocast_dtype, policy):
    """Under autocast, SDPA (on its lower-precision list) casts every floating input but a
    float64 one to the autocast dtype: the output's dtype, the gradients' the inputs'."""
    kwargs = dict(mask=("float", (NQ, NK)), dtype=input_dtype)
    inputs, kwargs = _inputs((B, H, NQ, D), (B, H, NK, D), kwargs, input_dtype, grad=True)
    with torch.autocast("cpu", dtype=autocast_dtype):
        torch_out = F.scaled_dot_product_attention(*inputs, **kwargs)
        with fp4_inductor.configure(policy=policy):
            out, fwd, _ = _ops_run(lambda: fp4_inductor.scaled_dot_product_attention(*inputs, **kwargs))
    assert out.dtype == torch_out.dtype == autocast_dtype and fwd == (policy == "always")
    out.float().square().sum().backward()
    assert all(t.grad.dtype == input_dtype for t in inputs)
    if policy != "always":
        torch.testing.assert_close(out, torch_out, rtol=0, atol=0)
    else:  # the output is that of the cast inputs
        cast = [t.detach().to(autocast_dtype) for t in inputs]
        mask = kwargs["attn_mask"].to(autocast_dtype)
        inputs64, kwargs64 = _float64(cast, dict(attn_mask=mask))
        assert_within_reference_error(out, F.scaled_dot_product_attention(*inputs64, **kwargs64),
                                      lowp_sdpa(*inputs64, **kwargs64), K_OUT)


# ---------------------------------------------------------------- errors torch raises


def _qkv(dtype=torch.bfloat16):
    return [torch.randn(B, H, n, D, dtype=dtype) for n in (NQ, NK, NK)]


ERRORS = {
    # the mask's dtype: boolean, float32 or the query's; anything else SDPA refuses
    "int64_mask": lambda: (_qkv(torch.float32), dict(attn_mask=torch.ones(NQ, NK, dtype=torch.int64))),
    "uint8_mask": lambda: (_qkv(torch.float32), dict(attn_mask=torch.ones(NQ, NK, dtype=torch.uint8))),
    "float64_mask": lambda: (_qkv(torch.float32), dict(attn_mask=torch.zeros(NQ, NK, dtype=torch.float64))),
    "fp16_mask_bf16_inputs": lambda: (_qkv(), dict(attn_mask=torch.zeros(NQ, NK, dtype=torch.float16))),
    "mask_does_not_broadcast": lambda: (_qkv(), dict(attn_mask=torch.zeros(NQ + 1, NK, dtype=torch.bool))),
    "one_dimensional_mask": lambda: (_qkv(), dict(attn_mask=torch.ones(NK, dtype=torch.bool))),
    "causal_bias_and_is_causal": lambda: (_qkv(), dict(attn_mask=causal_lower_right(NQ, NK), is_causal=True)),
    "dtypes_differ": lambda: ([_qkv()[0], *_qkv(torch.float16)[1:]], {}),
    "heads_differ_without_gqa": lambda: ([_qkv()[0], *(t[:, :2] for t in _qkv()[1:])], {}),
    "gqa_heads_do_not_divide": lambda: ([_qkv()[0], *(t[:, :3] for t in _qkv()[1:])], dict(enable_gqa=True)),
    "head_dims_differ": lambda: ([_qkv()[0][..., :16], *_qkv()[1:]], {}),
    "one_dimensional": lambda: ([torch.randn(D, dtype=torch.bfloat16)] * 3, {}),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", ERRORS)
def test_errors_as_sdpa_raises(case, policy):
    """Where SDPA raises, the drop-in raises the same exception type and message (and
    never answers with the mask read as a bias)."""
    inputs, kwargs = ERRORS[case]()
    with pytest.raises(Exception) as torch_error:
        F.scaled_dot_product_attention(*inputs, **kwargs)
    with fp4_inductor.configure(policy=policy), pytest.raises(type(torch_error.value)) as error:
        fp4_inductor.scaled_dot_product_attention(*inputs, **kwargs)
    assert str(error.value) == str(torch_error.value)


def test_integer_mask_is_not_read_as_a_bias_where_sdpa_takes_the_call():
    """A 0/1 mask of the query's own dtype is a bias SDPA adds (it takes it): the drop-in
    adds it too, rather than reading it as keep/drop."""
    inputs = _qkv()
    mask = (torch.rand(NQ, NK) > 0.5).to(torch.bfloat16)
    with fp4_inductor.configure(policy="always"):
        out = fp4_inductor.scaled_dot_product_attention(*inputs, attn_mask=mask)
    inputs64, kwargs64 = _float64(inputs, dict(attn_mask=mask))
    exact = F.scaled_dot_product_attention(*inputs64, **kwargs64)
    assert_within_reference_error(out, exact, lowp_sdpa(*inputs64, **kwargs64), K_OUT)
    assert rel_l2(out, F.scaled_dot_product_attention(*inputs64, attn_mask=mask.bool())) > 4 * rel_l2(out, exact)
