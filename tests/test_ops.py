"""The fp4attn custom ops: schema, fake kernels (strides as the real ones), autograd."""

import math

import pytest
import torch

from fp4_inductor import formats as F
from fp4_inductor import ops, quantized
from fp4_inductor.formats import mask_to_log2_bias
from helpers import bits, rel_l2


# test_schema compares inputs before and after with ops that CPU float8 lacks; mutation
# is checked by hand instead (_assert_not_mutated).
OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _opcheck(op, args):
    before = [bits(a).clone() for a in args if isinstance(a, torch.Tensor)]
    torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
    op(*args)
    after = [bits(a) for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def _fwd_args(b=2, h=4, hkv=2, nq=70, nk=150, d=64, causal=False, bias=False, p_mode="direct"):
    q, k, v = torch.randn(b, h, nq, d), torch.randn(b, hkv, nk, d), torch.randn(b, hkv, nk, d)
    operands = F.quantize_inputs(q, k, v, 1 / math.sqrt(d), "fp4" if p_mode == "fp4" else "fp8")
    mask = mask_to_log2_bias(torch.rand(b, 1, 1, nk) > 0.2) if bias else None
    return (*operands, mask, causal, p_mode, torch.bfloat16)


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_quantize_opcheck_and_matches_formats(fmt):
    q, k, v = torch.randn(2, 4, 70, 64), torch.randn(2, 2, 150, 64), torch.randn(2, 2, 150, 64)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a [B, N, H, D] layout, as projections give
    _opcheck(torch.ops.fp4attn.quantize.default, (q, k, v, 0.125, fmt))
    got = torch.ops.fp4attn.quantize(q, k, v, 0.125, fmt)
    q8, q_scale = F.quantize_q(q, 0.125)
    k8, k_scale = F.quantize_k(k)
    v_t, v_scale = F.quantize_v(v, fmt)
    want = (q8, k8, v_t, q_scale, k_scale, v_scale)
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.dtype == w.dtype and torch.equal(bits(g), bits(w))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("p_mode", ["direct", "exp", "fp4"])
def test_fwd_opcheck(causal, bias, p_mode):
    _opcheck(torch.ops.fp4attn.fwd.default, _fwd_args(causal=causal, bias=bias, p_mode=p_mode))


def test_fwd_fake_strides_match_real():
    args = _fwd_args()
    real = torch.ops.fp4attn.fwd(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = torch.ops.fp4attn.fwd(*fake_args)
    for f, r in zip(fake, real, strict=True):
        assert f.shape == r.shape and f.stride() == r.stride() and f.dtype == r.dtype
    out = real[0]
    # [B, H, N, D] stored as [B, N, H, D]: the usual transpose(1, 2).reshape is free.
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("grads_contiguous", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_opcheck(causal, grads_contiguous):
    q8, k8, v8t, qs, ks, vs, bias, causal, p_mode, dtype = _fwd_args(causal=causal, bias=True)
    out, lse, row_ref = torch.ops.fp4attn.fwd(q8, k8, v8t, qs, ks, vs, bias, causal, p_mode, dtype)
    do8, do_scale = F.quantize_do(torch.randn(out.shape), lse, row_ref, p_mode)
    delta = (do8.float() * do_scale[..., None, None] * out.float()).sum(-1)
    qe, qes, ke, kes = F.backward_operands(q8, qs, k8, ks)
    args = (do8, do_scale, delta, q8, k8, v8t, qs, ks, vs, qe, qes, ke, kes, bias, row_ref, causal, p_mode, dtype,
            grads_contiguous)
    _opcheck(torch.ops.fp4attn.bwd.default, args)
    dq, dk, dv = torch.ops.fp4attn.bwd(*args)
    assert dq.shape == (2, 4, 70, 64) and dk.shape == dv.shape == (2, 2, 150, 64)
    assert all(g.is_contiguous() == grads_contiguous for g in (dq, dk, dv))
    assert all(g.transpose(1, 2).is_contiguous() != grads_contiguous for g in (dq, dk, dv))


def test_gradients_come_in_the_inputs_layout():
    """Contiguous [B, H, N, D] inputs (leaves, say) get contiguous gradients, which autograd
    stores as they are (it re-lays out a strided one, a copy a step); inputs that are
    transposes of [B, N, H, D] tensors, as projections give, get [B, N, H, D] gradients.
    The numbers do not depend on the layout."""
    from fp4_inductor.attention import lowp_attention

    heads_major = [torch.randn(2, h, 70, 64, requires_grad=True) for h in (4, 2, 2)]
    tokens_major = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in heads_major]
    dout = torch.randn(2, 4, 70, 64)
    got_h = torch.autograd.grad(lowp_attention(*heads_major, is_causal=True), heads_major, dout)
    got_t = torch.autograd.grad(lowp_attention(*tokens_major, is_causal=True), tokens_major, dout)
    for h, t in zip(got_h, got_t, strict=True):
        assert h.is_contiguous() and t.transpose(1, 2).is_contiguous()
        assert torch.equal(h, t)


def test_dq_comes_out_with_respect_to_q():
    """lowp_attention's dQ is the op's dQ for Q times the softmax scale (Ke's scales as
    ``formats.backward_operands`` gives them) times that scale, within one BF16 rounding:
    attention.py folds the scale into Ke's scales, so the op rounds dQ once.  D = 128,
    whose scale is not a power of two; 80 keys, which ``quantized.align_keys`` leaves as they are."""
    from fp4_inductor.attention import lowp_attention

    d, sm_scale = 128, 128 ** -0.5
    q, k, v = (torch.randn(2, h, 80, d, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(2, 4, 80, d, dtype=torch.bfloat16)
    dq, dk, dv = torch.autograd.grad(lowp_attention(q, k, v, is_causal=True), (q, k, v), dout)

    out, lse, row_ref, operands = quantized.quantized_forward(
        q.detach(), k.detach(), v.detach(), None, sm_scale, True, "fp8", "direct")
    grad = quantized.grad_operands(dout, out, lse, row_ref, operands, "direct")
    dq_scaled, dk_op, dv_op = quantized.quantized_backward(grad, operands, None, row_ref, 1.0, True, "direct",
                                                     torch.bfloat16, False)
    assert torch.equal(dk, dk_op) and torch.equal(dv, dv_op)
    want = dq_scaled.float() * sm_scale
    # (plus a floor for rows whose dS is all cancellation: query 0 of a causal head)
    bound = torch.finfo(torch.bfloat16).eps * want.abs() + 1e-6 * want.abs().max()
    assert ((dq.float() - want).abs() <= bound).all()
    assert not torch.equal(dq, (dq_scaled * sm_scale).to(torch.bfloat16))  # the fold changes roundings


def test_backward_op_takes_the_one_kernel_operands(fresh_seed):
    """``fp4attn::bwd`` given the one-kernel backward's operands (the forward's INT8 codes in
    place of Qe and Ke, K's scales times the softmax scale, dO in E4M3) on a path that reads
    copies derives them: the same gradients as from the copies themselves (the reference
    path here; D = 64, whose softmax scale 1/8 the derivation recovers exactly)."""
    from bwd_checks import operands

    ops = operands(1, 4, 2, 96, 112, 64, "direct", True, fused=True)
    assert ops[0].dtype == F.E4M3 and ops[9].dtype == ops[11].dtype == torch.int8
    qe, qes, ke, kes = F.backward_operands(ops[3], ops[6], ops[4], ops[7])
    tail = (True, "direct", torch.float32)
    from_codes = torch.ops.fp4attn.bwd(*ops[:12], ops[12] * 0.125, *ops[13:], *tail)
    from_copies = torch.ops.fp4attn.bwd(*ops[:9], qe, qes, ke, kes * 0.125, *ops[13:], *tail)
    for name, a, b in zip("qkv", from_codes, from_copies):
        assert torch.equal(a, b), f"d{name} differs"


def test_backward_graph_hands_the_one_kernel_operands_where_it_applies(fresh_seed, monkeypatch):
    """Where the one-kernel backward is for a call (``kernels.fused_backward_applies``) the
    backward graph quantizes dO to E4M3 and passes the forward's codes, deriving no E4M3
    copies (here the reference path derives them, once); its gradients, with E4M3 dO, are
    closer to float64's than the E5M2 path's."""
    from fp4_inductor import kernels
    from fp4_inductor.attention import lowp_attention

    q, k, v = (torch.randn(1, h, 96, 64, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(1, 4, 96, 64, dtype=torch.bfloat16)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=True,
                                                                                enable_gqa=True), exact, dout.double())
    derived = []
    derive = F.backward_operands_in_place_of_codes
    monkeypatch.setattr(F, "backward_operands_in_place_of_codes", lambda *a: derived.append(1) or derive(*a))
    errors = []
    for fused in (False, True):
        monkeypatch.setattr(kernels, "fused_backward_applies", lambda *a, fused=fused: fused)
        grads = torch.autograd.grad(lowp_attention(q, k, v, is_causal=True), (q, k, v), dout)
        assert len(derived) == fused, "the copies were derived from codes the graph did not pass"
        errors.append([rel_l2(g, w) for g, w in zip(grads, want)])
    for name, e5m2, e4m3 in zip("qkv", *errors):
        assert e4m3 < e5m2, f"d{name}: {e4m3:.4f} with the one-kernel operands, {e5m2:.4f} without"
    # The same through AOTAutograd's trace (fake tensors: the op's fake kernel and the E4M3
    # dO in a traced graph), against eager.
    compiled = torch.compile(lambda *t: lowp_attention(*t, is_causal=True), backend="aot_eager", fullgraph=True)
    eager = torch.autograd.grad(lowp_attention(q, k, v, is_causal=True), (q, k, v), dout)
    traced = torch.autograd.grad(compiled(q, k, v), (q, k, v), dout)
    assert len(derived) == 3, "the traced graph did not pass the codes"
    for name, a, b in zip("qkv", traced, eager):
        assert torch.equal(a, b), f"d{name}: traced differs from eager"


def test_ops_are_pt2_compliant_and_have_no_second_derivative():
    """The ops carry the tag torch.compile's checks look for, and a double backward through
    lowp_attention raises our error (fp4attn::bwd has no gradient) instead of returning a
    dQ with no graph, whose second-order term would vanish: ``grad(dq.sum() + (q * q).sum(),
    q)`` gave 2q.  A first-order backward is unaffected."""
    from fp4_inductor.attention import lowp_attention

    for name in ("quantize", "fwd", "bwd", "by_length"):
        assert torch.Tag.pt2_compliant_tag in getattr(torch.ops.fp4attn, name).default.tags, name
    q, k, v = (torch.randn(1, 2, 40, 32, requires_grad=True) for _ in range(3))
    for backward in ("lowp", "bf16"):  # the FP8 backward, and the hybrid path's BF16 one
        for dout in (None, torch.randn(1, 2, 40, 32, requires_grad=True)):  # dO a constant, and dO with a graph
            out = lowp_attention(q, k, v, is_causal=True, backward=backward)
            with pytest.raises(RuntimeError, match="fp4attn: low-precision attention has no second derivative"):
                torch.autograd.grad(out, q, torch.ones_like(out) if dout is None else dout, create_graph=True)
    dq, = torch.autograd.grad(lowp_attention(q, k, v, is_causal=True).sum(), q)
    assert dq.isfinite().all() and dq.abs().sum() > 0


@pytest.mark.parametrize("nk", [40, 150])
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_by_length_branches_on_the_call_s_key_length(nk, mask):
    """From min_keys keys on the low-precision path (quantize + fwd), below it SDPA; both
    in the layout the fake promises, masks and GQA as SDPA means them."""
    q, k, v = torch.randn(2, 4, 33, 64), torch.randn(2, 2, nk, 64), torch.randn(2, 2, nk, 64)
    keep = torch.rand(2, 1, 33, nk) > 0.2
    attn_mask = {None: None, "bool": keep, "additive": torch.where(keep, 0.0, -1e4) + torch.randn(2, 1, 33, nk)}[mask]
    args = (q, k, v, attn_mask, 0.125, True, "fp8", "direct", 100)
    _opcheck(torch.ops.fp4attn.by_length.default, args)
    got, empty = torch.ops.fp4attn.by_length(*args)
    causal = torch.ones(33, nk, dtype=torch.bool).tril()
    visible = causal if mask is None else causal & keep if mask == "bool" else causal & (attn_mask > -7.3e5)
    assert torch.equal(empty, ~visible.expand(2, 4, 33, nk).any(-1))  # rows with no visible key, either branch
    if nk >= 100:  # 150 keys: padded to 160 by quantized.align_keys
        k, v, bias = quantized.align_keys(k, v, attn_mask, None)
        want = quantized.quantized_forward(q, k, v, bias, 0.125, True, "fp8", "direct")[0]
    else:
        sdpa_mask = attn_mask.to(q.dtype) if mask == "additive" else attn_mask
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=sdpa_mask, is_causal=True, scale=0.125, enable_gqa=True)
    assert got.stride() == ops.bnhd_empty(q, 4, 33, 64, q.dtype).stride()
    assert torch.equal(got, want)


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_unaligned_keys_attend_to_their_own_keys(mask):
    """150 keys (not a multiple of quantized.KEY_ALIGN): the op sees 160, the 10 zero keys
    appended masked off, with the caller's mask and key padding alike.  Output and
    gradients against float64 SDPA over the 150 keys.  The real scores sit near -10 and a
    zero key scores 0, so a padded key that leaked in would take most of each row's
    probability (its value is 0: the output would all but vanish)."""
    from fp4_inductor.attention import lowp_attention

    nk, shift = 150, torch.zeros(64, dtype=torch.float64)
    shift[0] = 9.0  # q.k ~ -81 + noise, times the scale 1/8
    q, k, v = (torch.randn(2, h, n, 64, dtype=torch.float64) for h, n in ((4, 33), (2, nk), (2, nk)))
    q, k = q - shift, k + shift
    keep = torch.rand(2, 1, 33, nk) > 0.2
    attn_mask = {None: None, "bool": keep, "additive": torch.where(keep, 0.0, -1e4) + torch.randn(2, 1, 33, nk)}[mask]
    key_padding = torch.arange(nk) < torch.tensor([[nk], [nk - 20]])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = lowp_attention(*(t.bfloat16() for t in leaves), attn_mask, key_padding=key_padding)
    dout = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, leaves, dout)

    pad = ~key_padding[:, None, None, :]
    if mask == "additive":
        exact_mask = attn_mask.double().masked_fill(pad, -math.inf)
    else:
        exact_mask = ~pad if mask is None else keep & ~pad
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*exact, attn_mask=exact_mask, enable_gqa=True)
    want_grads = torch.autograd.grad(want, exact, dout.double())
    assert rel_l2(got.double(), want) < 0.06
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.shape == w.shape and rel_l2(g.double(), w) < 0.15


def test_lowp_attention_refuses_what_it_would_get_wrong():
    """Called directly (the compiler leaves these to SDPA): a mask or scale that requires
    grad would lose its gradient, a key head dim unlike the query's is no attention.  A
    value head dim of its own is computed."""
    from fp4_inductor.attention import lowp_attention

    q, k, v = (torch.randn(1, 2, 33, 64) for _ in range(3))
    bias = torch.randn(1, 1, 33, 33, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        lowp_attention(q, k, v, attn_mask=bias)
    with pytest.raises(ValueError, match="requires grad"):
        lowp_attention(q, k, v, scale=torch.tensor(0.125, requires_grad=True))
    with pytest.raises(ValueError, match="head dims differ"):
        lowp_attention(q, k[..., :32], v)
    assert lowp_attention(q, k, v[..., :40]).shape == (1, 2, 33, 40)
    with torch.no_grad():  # nothing to differentiate: the mask is only a value
        assert lowp_attention(q, k, v, attn_mask=bias).shape == q.shape


def test_a_tensor_scale_is_folded_into_q_once_for_every_path():
    """A tensor softmax scale (or a symbolic one) reaches every path as ``formats.fold_scale``'s
    Q with a scale of 1: the FP8 path, the run-time length branch (``min_keys``), the hybrid
    path and the BF16 causal path give what they give for that Q, bit for bit."""
    from fp4_inductor.attention import lowp_attention
    from fp4_inductor.runtime import causal_sdpa

    q, k, v = (torch.randn(1, 2, 48, 64, dtype=torch.bfloat16) for _ in range(3))
    scale = torch.tensor(0.3)
    folded = F.fold_scale(q, scale)
    assert folded.dtype == q.dtype and not torch.equal(folded, q)
    with torch.no_grad():
        want = lowp_attention(folded, k, v, scale=1.0, is_causal=True)
        assert torch.equal(lowp_attention(q, k, v, scale=scale, is_causal=True), want)
        assert torch.equal(lowp_attention(q, k, v, scale=scale, is_causal=True, min_keys=16), want)
        assert torch.equal(causal_sdpa(q, k, v, scale=scale),
                           torch.nn.functional.scaled_dot_product_attention(folded, k, v, is_causal=True, scale=1.0))
    q.requires_grad_()
    got = lowp_attention(q, k, v, scale=scale, is_causal=True, backward="bf16")
    assert torch.equal(got, lowp_attention(folded, k, v, scale=1.0, is_causal=True, backward="bf16"))
    dq, = torch.autograd.grad(got.float().sum(), q)
    assert dq.isfinite().all() and dq.abs().sum() > 0


def test_a_failing_kernel_raises_with_the_call_not_the_reference(monkeypatch):
    """A kernel that fails is the user's error to see, with what the call was: the float64
    reference standing in on a GPU ran orders of magnitude slower behind one warning."""
    def broken(*args):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(ops, "forward_kernel", lambda q, p_mode: broken)
    with pytest.raises(ops.KernelError, match=r"fp4attn::fwd kernel failed for operands \(2, 4, 70, 64\) int8.*"
                                              r"launch failed"):
        torch.ops.fp4attn.fwd(*_fwd_args())
