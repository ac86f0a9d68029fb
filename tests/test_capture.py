"""Every way of writing attention is captured (inference and training), the traps stay
exactly as written, and unsupported sites fall back with a reason."""

import pytest
import torch

import fp4_inductor
from fp4_inductor.compiler import SourceIdentity
from attention_variants import (B, CAPTURED, MASKED, SDPA_FORM, TRAPS, C, D, N, DropoutEval, SdpaDropoutEval,
                                SoftmaxOverQueries, extra_inputs)
from attention_checks import FAULTS, assert_faults_rejected, assert_within_reference_error, fp64_copy, lowp_reference
from helpers import cosine, op_calls

# Q and K projections (and their bias) times this: scores of std about 3, where a wrong
# scale or mask moves the output (default-initialised, a halved scale scored 0.991 cosine).
QK_GAIN = 2.5
# Our error over the low-precision reference's, outputs and gradients: 1.1-1.25 measured
# on the fp8 path, the faults' 9 and more.  fp4 (its affine P above the reference's
# nearest rounding): 1.7-1.8 over 7 seeds; a halved scale 3.1-3.2, uniform attention 5.1-5.3.
K_ERR, K_FP4 = 2.0, 2.3


def _input(module):
    dtype = next(module.parameters()).dtype
    return torch.randn(B, N, C, dtype=dtype)


def _peaked(module):
    with torch.no_grad():
        k_rows = module.kv_heads * D  # kv's rows: K's heads, then V's
        for t in (module.q.weight, module.q.bias, module.kv.weight[:k_rows], module.kv.bias[:k_rows]):
            t.mul_(QK_GAIN)
    return module


def _references(module, run, fmt="fp8"):
    """``run(module)`` on fp64 copies: the variant itself (exact) and its SDPA form with the
    same weights in low precision."""
    variant = type(module)
    exact = run(fp64_copy(module))
    sdpa_form = SDPA_FORM.get(variant, variant)().to(next(module.parameters()).dtype)
    sdpa_form.load_state_dict(module.state_dict(), strict=False)  # (a causal buffer it has no use for)
    with lowp_reference(fmt):
        lowp = run(fp64_copy(sdpa_form.train(module.training)))
    return exact, lowp


def _double(*tensors):
    return [t.double() if t.is_floating_point() else t for t in tensors]


@pytest.mark.parametrize("variant", CAPTURED, ids=lambda c: c.__name__)
def test_inference_captured(variant):
    module = _peaked(variant()).eval()
    x, extra = _input(module), extra_inputs(module)
    with torch.no_grad():
        exact, lowp = _references(module, lambda m: m(*_double(x, *extra)))
        check = lambda out: assert_within_reference_error(out, exact, lowp, K_ERR)
        with fp4_inductor.configure(policy="always"):
            compiled = torch.compile(module, backend="fp4attn")
            out, calls = op_calls(compiled, x, *extra)
            assert calls == {"fwd": 1, "bwd": 0}
            check(out)
            assert_faults_rejected(lambda: compiled(x, *extra), check,
                                   FAULTS if variant in MASKED else ("half_scale", "zero_output"))


@pytest.mark.parametrize("variant", [v for v in CAPTURED if v is not SdpaDropoutEval], ids=lambda c: c.__name__)
def test_training_captured(variant):
    module = _peaked(variant()).train()
    x = _input(module)
    extra = extra_inputs(module)
    grad_out = torch.randn(B, N, C, dtype=x.dtype)

    def step(fn, x, extra):
        x = x.clone().requires_grad_()
        fn.zero_grad()
        out = fn(x, *extra)
        out.backward(grad_out.to(out.dtype))
        return out.detach(), x.grad.clone(), fn.q.weight.grad.clone(), fn.kv.weight.grad.clone()

    exact, lowp = _references(module, lambda m: step(m, *_double(x), _double(*extra)))
    compiled = torch.compile(module, backend="fp4attn")

    def check_grads(got):
        for name, a, b, c in zip(("dx", "dWq", "dWkv"), got[1:], exact[1:], lowp[1:]):
            assert_within_reference_error(a, b, c, K_ERR, name)

    with fp4_inductor.configure(policy="always"):
        got, calls = op_calls(step, compiled, x, extra)
        assert calls == {"fwd": 1, "bwd": 1}
        assert_within_reference_error(got[0], exact[0], lowp[0], K_ERR)
        check_grads(got)
        # The gradients' bounds alone reject the faults (the outputs' is checked above).
        assert_faults_rejected(lambda: step(compiled, x, extra), check_grads,
                               FAULTS if variant in MASKED else ("half_scale", "zero_output"))


# SoftmaxOverQueries is checked against eager below: Inductor alone miscompiles it.
@pytest.mark.parametrize("variant", [t for t in TRAPS if t is not SoftmaxOverQueries], ids=lambda c: c.__name__)
def test_traps_stay_exact(variant):
    module = variant().eval()
    x = torch.randn(B, N, C)
    report = fp4_inductor.explain(module, x, policy="always")
    assert report.sites and all(s.path == "bf16" for s in report.sites)
    assert any(TRAPS[variant] in s.reason for s in report.sites)
    torch._dynamo.reset()
    torch.manual_seed(0)
    default, _ = op_calls(torch.compile(module), x)  # same calls, same random stream
    torch._dynamo.reset()
    torch.manual_seed(0)
    with fp4_inductor.configure(policy="always"):
        ours, calls = op_calls(torch.compile(module, backend="fp4attn"), x)
    assert calls["fwd"] == 0
    assert torch.equal(ours, default)


def test_softmax_over_the_queries_stays_as_eager_computes_it():
    """Left as written, then compiled by Inductor with its pattern matcher off for that
    graph: its attention fusion takes softmax over dim -2 for attention (rel-L2 0.19
    against eager in torch 2.13)."""
    module = SoftmaxOverQueries().eval()
    x = torch.randn(B, N, C)
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(module, backend="fp4attn"), x)
        ref = module(x)
    assert calls["fwd"] == 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_key_transposed_with_mT_is_captured():
    q, k, v = (torch.randn(2, 4, 96, 64) for _ in range(3))

    def attend(q, k, v):
        return torch.softmax(q @ k.mT * 0.125, dim=-1) @ v

    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(attend, backend="fp4attn"), q, k, v)
    assert calls["fwd"] == 1 and cosine(out, attend(q, k, v)) > 0.99


@pytest.mark.parametrize("dim, other", [(-1, False), (3, False), (-2, True), (1, True)])
def test_softmax_over_another_dim_is_found_whatever_the_site_s_reason(dim, other):
    """The compiler turns Inductor's pattern matcher off for any such graph, not only where
    the site's first reason is the softmax's dimension (here K is not transposed, N = D)."""
    from fp4_inductor.patterns.softmax import softmax_over_other_dim

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(softmax_over_other_dim(gm.graph))
        return gm.forward

    q, k, v = (torch.randn(2, 4, 64, 64) for _ in range(3))
    torch.compile(lambda q, k, v: torch.softmax(q @ k * 0.125, dim=dim) @ v, backend=capture)(q, k, v)
    assert graphs == [other]


def test_learned_mask_is_a_value_under_no_grad():
    """A mask that requires grad falls back in training only: under no_grad it is data."""
    bias = torch.nn.Parameter(torch.randn(N, N))
    q, k, v = (torch.randn(B, 4, N, 64) for _ in range(3))

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    assert "requires grad" in fp4_inductor.explain(attend, q, k, v, policy="always").sites[0].reason
    with torch.no_grad():
        assert [s.path for s in fp4_inductor.explain(attend, q, k, v, policy="always").sites] == ["fp8"]


def test_explain_again_and_again_leaves_later_compiles_working():
    # Every probe compiles the model's forward anew; kept in Dynamo's cache, more of them
    # than its recompile limit would make a later compile run the model eagerly.
    variant = CAPTURED[0]
    x = _input(variant())
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        report = fp4_inductor.explain(variant().eval(), x, policy="always")
        assert [s.path for s in report.sites] == ["fp8"]
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        _, calls = op_calls(torch.compile(variant().eval(), backend="fp4attn"), x)
    assert calls == {"fwd": 1, "bwd": 0}


def test_boolean_tensor_added_to_the_scores_adds_one():
    """softmax(S + m) with a boolean m adds 1 where m is True, as eager's type promotion
    does; it is not SDPA's boolean attn_mask (keep where True)."""
    q, k, v = (torch.randn(2, 4, 128, 64) for _ in range(3))
    m = torch.rand(128, 128) > 0.5

    def attend(q, k, v, m):
        return torch.softmax(q @ k.transpose(-2, -1) / 8 + m, dim=-1) @ v

    with fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(attend, backend="fp4attn"), q, k, v, m)
    assert calls["fwd"] == 1 and cosine(out, attend(q, k, v, m)) > 0.99


def test_sdpa_dropout_in_training_falls_back():
    module = SdpaDropoutEval().train()
    report = fp4_inductor.explain(module, torch.randn(B, N, C), policy="always")
    assert [s.path for s in report.sites] == ["bf16"]
    assert "dropout" in report.sites[0].reason


def test_dropout_modules_with_zero_p_are_transparent_in_training():
    module = DropoutEval().train()
    report = fp4_inductor.explain(module, torch.randn(B, N, C, requires_grad=True), policy="always")
    assert [s.path for s in report.sites] == ["fp8"]


@pytest.mark.parametrize("policy", ["never", "auto"])
def test_policy_never_and_cpu_auto_rewrite_nothing(policy):
    module = CAPTURED[0]().eval()
    x = torch.randn(B, N, C)
    report = fp4_inductor.explain(module, x, policy=policy)
    reason = "policy=never" if policy == "never" else "no low-precision kernel for this device"
    assert [(s.path, s.reason) for s in report.sites] == [("bf16", reason)]
    torch._dynamo.reset()
    default = torch.compile(module)(x)
    torch._dynamo.reset()
    with fp4_inductor.configure(policy=policy):
        ours, calls = op_calls(torch.compile(module, backend="fp4attn"), x)
    assert calls["fwd"] == 0 and torch.equal(ours, default)


def _sdpa(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize(
    "shape, dtype, kwargs, reason",
    [
        ((2, 4, 64, 20), torch.float32, {}, "head dim 20"),
        ((2, 4, 64, 264), torch.float32, {}, "head dim 264"),
        ((2, 4, 64, 64), torch.float64, {}, "dtypes"),
        ((2, 4, 64, 64), torch.float32, {"dropout_p": 0.2}, "dropout"),
    ],
)
def test_unsupported_sites_fall_back_with_reason(shape, dtype, kwargs, reason):
    q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
    report = fp4_inductor.explain(lambda q, k, v: _sdpa(q, k, v, **kwargs), q, k, v, policy="always")
    assert [s.path for s in report.sites] == ["bf16"]
    assert reason in report.sites[0].reason
    if not kwargs:
        torch._dynamo.reset()
        with fp4_inductor.configure(policy="always"):
            out = torch.compile(_sdpa, backend="fp4attn")(q, k, v)
        torch.testing.assert_close(out, _sdpa(q, k, v))


def test_mask_that_requires_grad_falls_back():
    q, k, v = (torch.randn(2, 4, 64, 64) for _ in range(3))
    bias = torch.randn(1, 4, 64, 64, requires_grad=True)
    report = fp4_inductor.explain(lambda q, k, v, b: _sdpa(q, k, v, attn_mask=b), q, k, v, bias, policy="always")
    assert report.sites[0].path == "bf16" and "requires grad" in report.sites[0].reason


def test_dynamic_sequence_lengths_keep_calling_the_op():
    module = CAPTURED[1]().eval()  # causal SDPA
    with fp4_inductor.configure(policy="always"):
        compiled = torch.compile(module, backend="fp4attn")
        for n in (64, 96, 144):
            x = torch.randn(B, n, C)
            with torch.no_grad():
                out, calls = op_calls(compiled, x)
                ref = module(x)
            assert calls["fwd"] >= 1, n
            assert cosine(out, ref) > 0.99


def test_symbolic_softmax_scale_is_handled():
    """scale computed from a dynamic size is a SymFloat under dynamic=True."""

    def fn(q, k, v):
        return _sdpa(q, k, v, scale=1.0 / q.shape[-2] ** 0.5)

    q, k, v = (torch.randn(2, 4, 96, 64) for _ in range(3))
    with fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(fn, backend="fp4attn", dynamic=True), q, k, v)
    assert calls["fwd"] >= 1
    assert cosine(out, fn(q, k, v)) > 0.99


def test_backend_options_fp4_format():
    """fmt="fp4" within the bound of an MXFP4 reference (P and V in E2M1), which rejects
    uniform attention, a halved scale and zeros (the old cosine > 0.8 passed uniform
    attention at 0.96-0.97)."""
    module = _peaked(CAPTURED[0]()).eval()
    x = torch.randn(B, N, C)
    with torch.no_grad():
        exact, lowp = _references(module, lambda m: m(x.double()), fmt="fp4")
        check = lambda out: assert_within_reference_error(out, exact, lowp, K_FP4)
        compiled = torch.compile(module, backend=fp4_inductor.backend(policy="always", fmt="fp4"))
        out, calls = op_calls(compiled, x)
        assert calls["fwd"] >= 1
        check(out)
        uniform = module.o(module.heads(x)[2].mean(-2, keepdim=True).expand(B, -1, N, -1).transpose(1, 2)
                           .reshape(B, N, C))
        with pytest.raises(AssertionError):
            check(uniform)
        assert_faults_rejected(lambda: compiled(x), check, ("half_scale", "zero_output"))


def test_explain_report_fields_and_table():
    module = CAPTURED[1]().eval()
    report = fp4_inductor.explain(module, torch.randn(B, N, C), policy="always")
    (site,) = report.sites
    assert (site.kind, site.shape, site.causal, site.path) == ("sdpa", (B, 4, 4, N, N, 64), True, "fp8")
    assert site.predicted_speedup is None and site.reason.startswith("policy=always")
    text = str(report)
    assert "sdpa" in text and "2,4,4,80,80,64" in text and "fp8" in text


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_modes_reach_inductor(mode):
    module = CAPTURED[1]().eval()
    x = torch.randn(B, N, C)
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(module, backend="fp4attn", mode=mode), x)
        ref = module(x)
    assert calls["fwd"] == 1 and cosine(out, ref) > 0.99


def test_inductor_options_are_applied(monkeypatch):
    from torch._inductor import compile_fx as inductor

    seen = []
    real = inductor.compile_fx

    def spy(gm, example_inputs, **kwargs):
        seen.append(kwargs.get("config_patches"))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", spy)
    module = CAPTURED[0]().eval()
    with torch.no_grad():
        torch.compile(module, backend=fp4_inductor.backend(policy="always"), options={"epilogue_fusion": False})(torch.randn(B, N, C))
    assert {k: v for k, v in seen[0].items() if k != "post_grad_custom_pre_pass"} == {"epilogue_fusion": False}
    assert isinstance(seen[0]["post_grad_custom_pre_pass"], SourceIdentity)  # the cache's key on our sources


def test_exported_program_is_rewritten():
    """torch.compile of an exported module: its graph holds aten.scaled_dot_product_attention."""

    class Attend(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 40, 3, 2, 32).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    module = Attend().eval()
    x = torch.randn(2, 40, 64)
    exported = torch.export.export(module, (x,)).module()
    with torch.no_grad():
        ref = module(x)
        with fp4_inductor.configure(policy="always"):
            out, calls = op_calls(torch.compile(exported, backend="fp4attn"), x)
    assert calls["fwd"] == 1
    assert cosine(out, ref) > 0.99


def test_sdpa_backend_op_is_rewritten():
    """An aten-level graph calling a backend op (_scaled_dot_product_flash_attention_for_cpu
    here; flash/efficient/cuDNN on CUDA) whose output alone is used."""

    def attend(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]

    q, k, v = (torch.randn(2, 2, 40, 32) for _ in range(3))
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = op_calls(torch.compile(attend, backend="fp4attn"), q, k, v)
    assert calls["fwd"] == 1
    assert cosine(out, attend(q, k, v)) > 0.99


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant", "selective"])
def test_attention_inside_activation_checkpointing(mode):
    """torch.utils.checkpoint (both modes, and selective checkpointing): the body graph is
    rewritten, and the recomputed forward quantizes as the first did (gradients equal to
    the uncheckpointed compile's)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    layer = torch.nn.Linear(64, 192)

    def attend(x):
        q, k, v = layer(x).view(2, 48, 3, 2, 32).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def policy(ctx, op, *args, **kwargs):  # keep the matmuls, recompute the rest
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    kwargs = {"use_reentrant": mode == "reentrant"}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)

    def step(fn, x):
        layer.zero_grad()
        fn(x).pow(2).mean().backward()
        return torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()])

    x = torch.randn(2, 48, 64)
    with fp4_inductor.configure(policy="always"):
        plain = step(torch.compile(attend, backend="fp4attn"), x)
        torch._dynamo.reset()
        checkpointed, calls = op_calls(step, torch.compile(lambda x: checkpoint(attend, x, **kwargs),
                                                           backend="fp4attn"), x)
    assert calls["fwd"] >= 1 and calls["bwd"] == 1
    # Equal but for float rounding: the two compiled graphs may round the projection
    # differently, which can flip one 8-bit code (21 seeds: 1 - 1e-14 typically, 0.99989
    # once, seed 274823293); a broken recompute gives far less.
    assert cosine(checkpointed, plain) >= 0.9995
    assert cosine(checkpointed, step(attend, x)) >= 0.98


class _Registry:
    """Module-level state, as a library's registry of active kernels is."""

    def __init__(self):
        self.active = None


_REGISTRY = _Registry()


def test_side_effect_in_a_checkpointed_body_is_explained():
    """A checkpointed body that sets state outside itself (as transformers >= 5.25's hub-kernel
    wrapper does in each attention) makes Dynamo run the whole frame eagerly; ``explain``
    passes on Dynamo's hint, and with the flag it names, the site is rewritten."""
    from torch.utils.checkpoint import checkpoint

    def attend(x):
        previous, _REGISTRY.active = _REGISTRY.active, {"rotary": _Registry()}  # set and reset, as a context
        q, k, v = x.view(2, 48, 3, 2, 32).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        _REGISTRY.active = previous
        return out

    x = torch.randn(2, 48, 192, requires_grad=True)
    step = lambda x: checkpoint(attend, x, use_reentrant=False)  # noqa: E731
    text = str(fp4_inductor.explain(step, x, policy="always"))
    assert "captured no graph" in text and "skip_fwd_side_effects_in_bwd_under_checkpoint" in text, text
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        report = fp4_inductor.explain(step, x, policy="always")
    assert [s.mask for s in report.sites] == ["causal"] and not report.graph_breaks, str(report)
