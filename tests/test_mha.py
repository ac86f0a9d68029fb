"""nn.MultiheadAttention and nn.TransformerEncoderLayer, which reach the graph as one
opaque F.multi_head_attention_forward call.

Query and key projections are scaled for peaked scores, errors bounded by a multiple of
the low-precision reference's and the bounds checked to reject faulty attention
(tests/attention_checks.py)."""

import pytest
import torch
from torch import nn

import fp4_inductor
from attention_checks import (assert_faults_rejected, assert_within_reference_error, fp64_copy, lowp_reference,
                              FAULTS)
from helpers import op_calls

B, N, E, H = 2, 80, 256, 4
# Scores' std about 3 at this gain on xavier-initialised projections.
QK_GAIN = 2.5
# Our error over the low-precision reference's: 1.1-1.25 measured; the faults' 9 and more.
K_ERR = 2.0
NO_MASK_FAULTS = ("half_scale", "zero_output")
# An additive mask's std: ignoring it moves the output by several times the bound.
MASK_STD = 3.0


def _peaked(mha: nn.MultiheadAttention) -> nn.MultiheadAttention:
    with torch.no_grad():
        if mha.in_proj_weight is not None:
            mha.in_proj_weight[: 2 * mha.embed_dim].mul_(QK_GAIN)
        else:
            mha.q_proj_weight.mul_(QK_GAIN)
            mha.k_proj_weight.mul_(QK_GAIN)
    return mha


def _references(module, run, x):
    """``run(module, x)`` on fp64 copies, exact and with SDPA in low precision, with grad
    mode on: the slow path, whose SDPA call the low-precision one replaces."""
    with torch.enable_grad():
        exact = run(fp64_copy(module), x.double())
        with lowp_reference():
            lowp = run(fp64_copy(module), x.double())
    return exact, lowp


def _check(got, exact, lowp):
    assert_within_reference_error(got, exact, lowp, K_ERR)


def _captured_within_bound(module, run, x):
    """``run(module, x)`` compiled under policy always without grad: one call of our
    forward, the output within the bound (so that a fault in it fails the test)."""
    exact, lowp = _references(module, lambda m, x: run(m, x).detach(), x)
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(lambda x: run(module, x), backend="fp4attn"), x)
    assert calls["fwd"] == 1
    _check(out, exact, lowp)


class SelfAttention(nn.Module):
    def __init__(self, batch_first=True, **kwargs):
        super().__init__()
        self.attn = _peaked(nn.MultiheadAttention(E, H, batch_first=batch_first, **kwargs))

    def forward(self, x, key_padding_mask=None, attn_mask=None, is_causal=False):
        return self.attn(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False,
                         is_causal=is_causal)[0]


def _padding():
    pad = torch.rand(B, N) < 0.2
    pad[:, 0] = False
    return pad


CASES = {
    "plain": (dict(), lambda: {}),
    "key_padding": (dict(), lambda: {"key_padding_mask": _padding()}),
    "causal_hint": (dict(), lambda: {"attn_mask": nn.Transformer.generate_square_subsequent_mask(N), "is_causal": True}),
    "bool_attn_mask": (dict(), lambda: {"attn_mask": torch.rand(N, N) < 0.3}),
    "separate_proj": (dict(kdim=E, vdim=E, bias=False), lambda: {}),
}


def _run(module, x, kwargs, train, grad_out):
    module.train(train)
    if train:
        x = x.clone().requires_grad_()
        out = module(x, **kwargs)
        out.backward(grad_out.to(out.dtype))
        return out.detach(), x.grad
    with torch.no_grad():
        return module(x, **kwargs), None


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", list(CASES))
def test_multihead_attention_captured(case, train):
    ctor, make_kwargs = CASES[case]
    module = SelfAttention(**ctor)
    x, kwargs, grad_out = torch.randn(B, N, E), make_kwargs(), torch.randn(B, N, E)
    if "attn_mask" in kwargs and kwargs["attn_mask"].dtype == torch.bool:
        kwargs["attn_mask"][:, 0] = False  # every query keeps one key
    module.train(train)
    # (inference too with grad mode on: no_grad would take the fast path, which calls no SDPA)
    exact, lowp = _references(module, lambda m, x: _run(m, x, kwargs, True, grad_out) if train
                              else (m(x, **kwargs).detach(), None), x)

    def check(result):
        _check(result[0], exact[0], lowp[0])
        if train:
            assert_within_reference_error(result[1], exact[1], lowp[1], K_ERR, "dx")

    with fp4_inductor.configure(policy="always"):
        compiled = torch.compile(module, backend="fp4attn")
        run = lambda: _run(compiled, x, kwargs, train, grad_out)
        result, calls = op_calls(run)
        assert calls == {"fwd": 1, "bwd": 1 if train else 0}
        check(result)
        assert_faults_rejected(run, check, FAULTS if kwargs else NO_MASK_FAULTS)


def test_transformer_encoder_layer_training():
    layer = nn.TransformerEncoderLayer(E, H, 512, dropout=0.0, batch_first=True).train()
    _peaked(layer.self_attn)
    x = torch.randn(B, N, E)
    report = fp4_inductor.explain(layer, x, policy="always")
    assert [(s.kind, s.path, s.shape, s.training) for s in report.sites] == [("mha", "fp8", (B, H, H, N, N, 64), True)]
    exact, lowp = _references(layer, lambda m, x: m(x).detach(), x)
    with fp4_inductor.configure(policy="always"):
        compiled = torch.compile(layer, backend="fp4attn")
        out, calls = op_calls(compiled, x)
        assert calls["fwd"] == 1
        _check(out.detach(), exact, lowp)
        assert_faults_rejected(lambda: compiled(x).detach(), lambda out: _check(out, exact, lowp), NO_MASK_FAULTS)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda m, x: m.attn(x, x, x)[0], "need_weights=True"),
        (lambda m, x: m.attn(x, x, x, need_weights=False)[0], "dropout in training"),
    ],
)
def test_unsupported_multihead_attention_stays_exact(make, reason):
    """What the ops cannot take stays as written, with eager's numbers; the same module
    without it (need_weights=False, in eval) is captured."""
    module = SelfAttention(dropout=0.1).train()
    x = torch.randn(B, N, E)
    report = fp4_inductor.explain(lambda x: make(module, x), x, policy="always")
    assert report.sites[0].path == "bf16" and reason in report.sites[0].reason
    seed = int(torch.randint(0, 2**31, ()))

    def seeded(fn):
        torch.manual_seed(seed)
        return fn(x)

    # (fallback_random: Inductor draws dropout's mask with eager's generator, as eager does)
    with fp4_inductor.configure(policy="always"), torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(lambda x: make(module, x), backend="fp4attn")
        out, calls = op_calls(seeded, compiled)
    assert calls == {"fwd": 0, "bwd": 0}
    torch.testing.assert_close(out, seeded(lambda x: make(module, x)), rtol=1e-4, atol=1e-5)
    _captured_within_bound(module.eval(), lambda m, x: m.attn(x, x, x, need_weights=False)[0], x)


def test_multihead_attention_under_no_grad_is_inference():
    """The module's weights require grad, but under no_grad nothing trains: the site is
    an inference site (the policy has rates for those), and runs our forward."""
    module = SelfAttention().eval()
    x = torch.randn(B, N, E)
    with torch.no_grad():
        report = fp4_inductor.explain(module, x)
    (site,) = report.sites
    assert site.kind == "mha" and not site.training
    (site,) = fp4_inductor.explain(module, x).sites
    assert site.training
    _captured_within_bound(module, lambda m, x: m(x), x)


@pytest.mark.parametrize("masks", ["none", "key_padding", "per_head"])
def test_unbatched_multihead_attention_captured(masks):
    """nn.MultiheadAttention also takes one unbatched [L, E] sequence (its masks then
    [S] and [H, L, S]): a batch of one."""
    mha = _peaked(nn.MultiheadAttention(E, H)).eval()
    x = torch.randn(N, E)
    kwargs = {"need_weights": False}
    if masks == "key_padding":
        kwargs["key_padding_mask"] = torch.arange(N) >= N - 7
    elif masks == "per_head":
        kwargs["attn_mask"] = torch.randn(H, N, N)

    def attend(x):
        return mha(x, x, x, **kwargs)[0]

    double = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
    exact, lowp = _references(mha, lambda m, x: m(x, x, x, **double)[0].detach(), x)
    with torch.no_grad():
        report = fp4_inductor.explain(attend, x, policy="always")
        assert [(s.path, s.shape) for s in report.sites] == [("fp8", (1, H, H, N, N, E // H))]
        with fp4_inductor.configure(policy="always"):
            compiled = torch.compile(attend, backend="fp4attn")
            out, calls = op_calls(compiled, x)
            assert calls["fwd"] == 1 and out.shape == (N, E)
            _check(out, exact, lowp)
            assert_faults_rejected(lambda: compiled(x), lambda out: _check(out, exact, lowp),
                                   NO_MASK_FAULTS if masks == "none" else FAULTS)


def test_multihead_attention_mask_that_requires_grad_falls_back():
    """A learned mask (a relative-position bias, say) needs its gradient: left as written.
    Under no_grad nothing trains: the mask is a value, and the site is captured."""
    mha = _peaked(nn.MultiheadAttention(E, H, batch_first=True))
    bias = (torch.randn(N, N) * MASK_STD).requires_grad_()
    x = torch.randn(B, N, E)

    def attend(x):
        return mha(x, x, x, attn_mask=bias, need_weights=False)[0]

    report = fp4_inductor.explain(attend, x, policy="always")
    assert [s.path for s in report.sites] == ["bf16"] and "requires grad" in report.sites[0].reason
    with fp4_inductor.configure(policy="always"):
        torch.compile(attend, backend="fp4attn")(x).sum().backward()
    compiled_grad, bias.grad = bias.grad, None
    attend(x).sum().backward()
    torch.testing.assert_close(compiled_grad, bias.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # nothing trains: the learned mask is only a value
        report = fp4_inductor.explain(attend, x, policy="always")
    assert [s.path for s in report.sites] == ["fp8"]
    value = bias.detach()
    _captured_within_bound(mha, lambda m, x: m(x, x, x, attn_mask=value.to(x.dtype), need_weights=False)[0], x)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_encoder_fast_path_in_eval(norm_first, padded):
    """nn.TransformerEncoder in eval under no_grad runs PyTorch's fused layer
    (torch._transformer_encoder_layer_fwd): its attention runs our ops, key padding too."""
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0, norm_first=norm_first,
                                             activation="gelu" if norm_first else "relu")
    _peaked(layer.self_attn)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 40, 128)
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[1, 30:] = padded
    kwargs = {"src_key_padding_mask": pad} if padded else {}
    exact, lowp = _references(encoder, lambda m, x: m(x, **kwargs)[~pad].detach(), x)
    with torch.no_grad():
        with fp4_inductor.configure(policy="always"):
            compiled = torch.compile(encoder, backend="fp4attn")
            out, calls = op_calls(compiled, x, **kwargs)
            assert calls["fwd"] == 2
            _check(out[~pad], exact, lowp)
            assert_faults_rejected(lambda: compiled(x, **kwargs)[~pad], lambda out: _check(out, exact, lowp),
                                   FAULTS if padded else NO_MASK_FAULTS)


def test_native_multihead_attention_fast_path():
    mha = _peaked(torch.nn.MultiheadAttention(128, 4, batch_first=True)).eval()
    x = torch.randn(2, 40, 128)
    exact, lowp = _references(mha, lambda m, x: m(x, x, x, need_weights=False)[0].detach(), x)
    with torch.no_grad():
        with fp4_inductor.configure(policy="always"):
            compiled = torch.compile(lambda x: mha(x, x, x, need_weights=False)[0], backend="fp4attn")
            out, calls = op_calls(compiled, x)
            assert calls["fwd"] == 1
            _check(out, exact, lowp)
            assert_faults_rejected(lambda: compiled(x), lambda out: _check(out, exact, lowp), NO_MASK_FAULTS)


def test_explain_says_why_no_site_was_found():
    """A graph break before attention, a frame Dynamo skips, and a graph with no attention
    each get their own explanation."""
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    x = torch.randn(2, 16, 128)
    with torch.no_grad():  # the causal-mask check calls .item(): a graph break
        text = str(fp4_inductor.explain(encoder, x, mask=torch.nn.Transformer.generate_square_subsequent_mask(16),
                                        policy="always"))
    assert "graph break" in text and "item()" in text
    skipped = torch.compiler.disable(lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x))
    assert "captured no graph" in str(fp4_inductor.explain(lambda x: skipped(x), torch.randn(1, 2, 8, 32)))
    assert "no attention sites found in 1 graph" in str(fp4_inductor.explain(lambda x: x.sin() * 2, torch.randn(3)))
    # with key padding in place of the causal mask there is no break: the attention is captured
    _peaked(encoder.layers[0].self_attn)
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 10:] = True
    _captured_within_bound(encoder, lambda m, x: m(x, src_key_padding_mask=pad)[~pad], x)
