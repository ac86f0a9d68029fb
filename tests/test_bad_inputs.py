"""The bad-input grid: inputs users do pass, each either matching eager within the format's
error (non-finite pattern included) or falling back with a reason; none crashes.  On the
CPU (reference path, policy="always")."""

import pytest
import torch
import torch.nn.functional as F

import fp4_inductor
from helpers import compiled_graphs, cosine, op_calls


def _sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _compiled(fn, *args, **kw):
    torch._dynamo.reset()
    with fp4_inductor.configure(policy="always"):
        return op_calls(torch.compile(lambda *a: fn(*a, **kw), backend="fp4attn"), *args)


def _matches(fn, *args, cos=0.99, **kw):
    """Through our ops (one call), finite where eager is finite and close there."""
    ref = fn(*args, **kw)
    out, calls = _compiled(fn, *args, **kw)
    assert calls["fwd"] == 1, "did not run our op"
    finite = ref.isfinite()
    assert torch.equal(out.isfinite(), finite), "non-finite elements differ from eager's"
    if finite.any():
        assert cosine(out[finite], ref[finite]) >= cos
    return out, ref


def _qkv(b=2, h=4, nq=64, nk=64, d=32, hkv=None, dtype=torch.float32):
    hkv = hkv or h
    return torch.randn(b, h, nq, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype), \
        torch.randn(b, hkv, nk, d, dtype=dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "v"])
def test_non_finite_in_q_or_v_matches_eager_pattern(where, bad):
    """Q's scale is per token and V's amax skips non-finite values: eager's pattern exactly
    (a row for Q, a column for V)."""
    q, k, v = _qkv()
    {"q": q, "v": v}[where][1, 2, 9, 5] = bad
    _matches(_sdpa, q, k, v)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_in_k_is_never_hidden(bad):
    """K is INT8 with a mean over tokens and a scale per 128 keys: a non-finite key poisons
    its head (eager: about half its rows for Inf, every row for NaN).  Never finite where
    eager is not."""
    q, k, v = _qkv()
    clean = _compiled(_sdpa, q, k, v)[0]
    k[1, 2, 9, 5] = bad
    ref = _sdpa(q, k, v)
    out, calls = _compiled(_sdpa, q, k, v)
    assert calls["fwd"] == 1
    assert not (out.isfinite() & ~ref.isfinite()).any()
    others = torch.ones(2, 4, dtype=torch.bool)
    others[1, 2] = False
    # Other heads untouched: K's mean and scales are per head, so their codes and outputs
    # are those of the clean K, bit for bit, and as close to eager's as ever.
    assert torch.equal(out[others], clean[others])
    assert cosine(out[others], ref[others]) >= 0.99


def test_large_scores():
    """Scores of 1e4 and more: the row reference keeps codes in range, nothing overflows.
    The softmax is then nearly one-hot, and the INT8 scores' error (~0.4 % of |s|, some 40
    here) can pick another key where a row's top two are that close: a looser cosine."""
    q, k, v = _qkv()
    q, k = q * 30, k * 30  # |s| up to ~1e4 after the 1/sqrt(d) scale
    _matches(_sdpa, q, k, v, cos=0.95)


@pytest.mark.parametrize("n", [1, 7, 113, 203, 1023])
def test_lengths(n):
    _matches(_sdpa, *_qkv(b=1, h=2, nq=n, nk=n), is_causal=True)


def test_causal_with_fewer_queries_than_keys():
    _matches(_sdpa, *_qkv(nq=17, nk=70), is_causal=True)


@pytest.mark.parametrize("layout", ["transposed", "expanded", "sliced"])
def test_views(layout):
    q, k, v = _qkv()
    if layout == "transposed":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout == "expanded":
        k, v = k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(-1, 4, -1, -1)
    else:
        q, k, v = (t[..., ::2, :] for t in (q, k, v))
    _matches(_sdpa, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(dtype):
    out, ref = _matches(_sdpa, *_qkv(dtype=dtype), is_causal=True)
    assert out.dtype == dtype


MASK_SHAPES = [(64, 64), (2, 1, 1, 64), (2, 4, 64, 64), (1, 4, 1, 64)]


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_mask_shape_sdpa_takes(shape, kind):
    q, k, v = _qkv()
    keep = torch.rand(shape) > 0.3
    mask = keep if kind == "bool" else torch.where(keep, torch.randn(shape), float("-inf"))
    _matches(_sdpa, q, k, v, attn_mask=mask)


def test_mask_that_does_not_broadcast_is_reported_not_raised():
    """Eager raises for it, and so does the compiled call; explain reports the failed trace."""
    q, k, v = _qkv()
    mask = torch.zeros(3, 1, 64, 64)
    report = fp4_inductor.explain(lambda q, k, v: _sdpa(q, k, v, attn_mask=mask), q, k, v, policy="always")
    assert not report.sites and "broadcast" in report.error and "tracing failed" in str(report)
    with pytest.raises(RuntimeError):
        _sdpa(q, k, v, attn_mask=mask)
    with pytest.raises(Exception, match="broadcast"):
        _compiled(_sdpa, q, k, v, attn_mask=mask)


def test_mask_or_scale_that_requires_grad_falls_back():
    q, k, v = (t.requires_grad_() for t in _qkv())
    bias = torch.randn(1, 1, 64, 64, requires_grad=True)
    report = fp4_inductor.explain(lambda q, k, v: _sdpa(q, k, v, attn_mask=bias), q, k, v, policy="always")
    assert report.sites[0].path == "bf16" and "requires grad" in report.sites[0].reason


def test_dropout_in_training_falls_back():
    q, k, v = (t.requires_grad_() for t in _qkv())
    report = fp4_inductor.explain(lambda q, k, v: _sdpa(q, k, v, dropout_p=0.1), q, k, v, policy="always")
    assert report.sites[0].path == "bf16" and "dropout" in report.sites[0].reason


@pytest.mark.parametrize("enable_gqa", [True, False])
def test_gqa(enable_gqa):
    q, k, v = _qkv(hkv=2)
    if enable_gqa:
        _matches(_sdpa, q, k, v, enable_gqa=True)
    else:  # eager refuses unequal heads without enable_gqa; explain says so
        with pytest.raises(RuntimeError):
            _sdpa(q, k, v)
        report = fp4_inductor.explain(lambda q, k, v: _sdpa(q, k, v), q, k, v, policy="always")
        # The failed trace is named, with the call that failed.
        assert not report.sites and report.error is not None
        assert "tracing failed" in str(report) and "scaled_dot_product_attention" in report.error, report.error


@pytest.mark.parametrize("mask_kind", ["bool", "neg_inf", "finfo_min", "masked_fill"])
def test_fully_masked_rows_match_eager(mask_kind):
    """Query rows whose every key is masked: eager's zeros (SDPA: boolean and -inf masks),
    mean of V (finite fills) or NaN (a softmax over -inf), on the reference path."""
    torch.manual_seed(torch.initial_seed() % 2**31)
    q, k, v = (torch.randn(2, 4, 40, 32) for _ in range(3))
    keep = torch.rand(2, 1, 40, 40) > 0.3
    keep[:, :, :5] = False  # five rows with no visible key

    def fn(q, k, v, keep):
        if mask_kind == "bool":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        if mask_kind in ("neg_inf", "finfo_min"):
            fill = float("-inf") if mask_kind == "neg_inf" else torch.finfo(torch.float32).min
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, fill) * 1.0)
        scores = (q @ k.transpose(-2, -1) * 32**-0.5).masked_fill(~keep, float("-inf"))
        return F.softmax(scores, dim=-1) @ v

    ref = fn(q, k, v, keep)
    with fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(fn, backend="fp4attn"), q, k, v, keep)
    assert calls["fwd"] == 1
    empty = ~keep.expand(2, 4, 40, 40).any(-1)
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out[empty], ref[empty], equal_nan=True)
    assert cosine(out[~empty], ref[~empty]) > 0.99


def test_length_sweep_compiles_no_more_graphs_than_never():
    """Dynamic lengths crossing one 128-key block: the same graphs as policy="never" (a
    scale-block count that could be 1 once added a specialisation guard)."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sweep(compiled):
        with torch.no_grad():
            for n in (16, 7, 113, 203, 300, 1023):
                q = torch.randn(1, 2, n, 32)
                compiled(q, q, q)

    graphs = {policy: compiled_graphs(attend, policy, sweep) for policy in ("never", "always")}
    assert graphs["always"] <= graphs["never"], graphs
