"""Eager attention: ``fp4_inductor.scaled_dot_product_attention``, ``patch()``,
``attn_implementation="fp4attn"`` and the diffusers processors, against SDPA (policy
``always`` runs the reference emulation on a CPU; ``never`` must be SDPA bit for bit)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fp4_inductor
from fp4_inductor.attention import lowp_attention
from helpers import cosine, op_calls, rel_l2

ALWAYS = dict(policy="always")


def _qkv(b=2, h=4, hkv=4, n=80, d=64, requires_grad=False):
    q = torch.randn(b, h, n, d)
    k, v = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _reference(q, k, v, **kw):
    """SDPA in float64 (an additive mask too): what both paths are measured against."""
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw = dict(kw, attn_mask=mask.double())
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


MASKS = {
    "causal": lambda n: dict(is_causal=True),
    "bool": lambda n: dict(attn_mask=torch.rand(2, 1, n, n) > 0.3),
    "additive": lambda n: dict(attn_mask=torch.randn(2, 4, n, n)),
    "gqa": lambda n: dict(enable_gqa=True, is_causal=True),
}


@pytest.mark.parametrize("case", MASKS)
def test_drop_in_matches_sdpa(case):
    q, k, v = _qkv(hkv=2 if case == "gqa" else 4)
    kw = MASKS[case](q.shape[2])
    with fp4_inductor.configure(policy="never"):
        assert torch.equal(fp4_inductor.scaled_dot_product_attention(q, k, v, **kw), F.scaled_dot_product_attention(
            q, k, v, **kw))
    with fp4_inductor.configure(**ALWAYS):
        out = fp4_inductor.scaled_dot_product_attention(q, k, v, **kw)
    # the backend's function on the same call: the eager path adds no numerics of its own
    lowp_kw = {key: val for key, val in kw.items() if key != "enable_gqa"}
    assert torch.equal(out, lowp_attention(q, k, v, **lowp_kw))
    ref = _reference(q, k, v, **kw)
    assert cosine(out, ref) > 0.998 and rel_l2(out, ref) < 0.06


def test_training_gradients():
    q, k, v = _qkv(n=64, requires_grad=True)
    with fp4_inductor.configure(**ALWAYS):
        out = fp4_inductor.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = _reference(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for g, r in zip(grads, ref_grads):
        assert cosine(g, r) > 0.99 and rel_l2(g, r) < 0.15


@pytest.mark.parametrize("case,reason", [("head dim 20", "head dim 20 is not supported"),
                                         ("dropout", "dropout_p > 0")])
def test_fallback_is_sdpa_with_its_reason(case, reason):
    q, k, v = _qkv()
    if case == "dropout":
        kw = dict(dropout_p=0.5)
    else:
        q, k, v, kw = q[..., :20], k[..., :20], v[..., :20], {}
    torch.manual_seed(0)
    out = fp4_inductor.scaled_dot_product_attention(q, k, v, **kw)
    torch.manual_seed(0)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, **kw))
    report = fp4_inductor.explain(lambda: fp4_inductor.scaled_dot_product_attention(q, k, v, **kw), eager=True,
                                  **ALWAYS)
    assert [s.path for s in report.sites] == ["bf16"] and reason in report.sites[0].reason, str(report)


def test_auto_on_cpu_keeps_sdpa():
    q, k, v = _qkv()
    report = fp4_inductor.explain(lambda: fp4_inductor.scaled_dot_product_attention(q, k, v), eager=True,
                                  policy="auto")
    assert report.sites[0].reason == "no low-precision kernel for this device"


class _Block(torch.nn.Module):
    def __init__(self, d=128, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        o = fp4_inductor.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).flatten(2))


def test_inside_inductor_compiled_model_without_graph_break():
    block, x = _Block(), torch.randn(2, 48, 128, requires_grad=True)
    with fp4_inductor.configure(**ALWAYS):
        eager_out = block(x)
        assert torch._dynamo.explain(block)(x).graph_break_count == 0
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="inductor")
        out, calls = op_calls(lambda: compiled(x).sum().backward() or compiled(x))
    assert calls["fwd"] == 2 and calls["bwd"] == 1  # our ops ran inside Inductor's graph, backward too
    assert cosine(out, eager_out) > 0.9999


def test_patch_as_context_manager_and_call():
    original = F.scaled_dot_product_attention
    mha = torch.nn.MultiheadAttention(128, 4, batch_first=True).eval()
    x = torch.randn(2, 32, 128)
    with fp4_inductor.patch():  # with grad: MHA's Python path, not its fused fast path
        assert F.scaled_dot_product_attention is fp4_inductor.scaled_dot_product_attention
        report = fp4_inductor.explain(mha, x, x, x, need_weights=False, eager=True, **ALWAYS)
        assert [s.path for s in report.sites] == ["fp8"], str(report)  # MHA's own SDPA call, routed
    assert F.scaled_dot_product_attention is original
    p = fp4_inductor.patch()
    try:
        with fp4_inductor.patch():  # nested: leaving the inner one keeps the outer
            pass
        assert F.scaled_dot_product_attention is fp4_inductor.scaled_dot_product_attention
    finally:
        p.undo()
    assert F.scaled_dot_product_attention is original


# ----------------------------------------------------------------- transformers

transformers = pytest.importorskip("transformers")


def _causal_lm(name, attn):
    kw = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation=attn)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**kw, sliding_window=8))


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_hf_attn_implementation(name):
    ref_model = _causal_lm(name, "sdpa").eval()
    model = _causal_lm(name, "fp4attn").eval()
    model.load_state_dict(ref_model.state_dict())
    ids, mask = torch.randint(1, 128, (2, 24)), torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    keep = mask.bool()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask).logits
        with fp4_inductor.configure(policy="never"):  # the structure, as SDPA: transformers' own numbers
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits[keep], ref[keep])
        report = fp4_inductor.explain(model, input_ids=ids, attention_mask=mask, eager=True, **ALWAYS)
        want = "window 8+padding" if name == "mistral" else "causal+padding"
        assert [(s.name, s.mask, s.path) for s in report.sites] == [
            (f"model.layers.{i}.self_attn", want, "fp8") for i in range(2)], str(report)
        assert report.sites[0].shape == (2, 4, 2, 24, 24, 32)  # K/V heads not repeated
        with fp4_inductor.configure(**ALWAYS):
            out = model(input_ids=ids, attention_mask=mask).logits
            if name == "llama":  # decode through the cache: the causal offset
                new = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
                assert new.shape == (2, 27)
                torch._dynamo.reset()
                assert torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask).graph_break_count == 0
    assert cosine(out[keep], ref[keep]) > 0.99


def test_hf_unrecognised_mask_is_dense():
    """A mask transformers does not build from its causal, sliding or bidirectional mask
    functions (here a 4-D mask of the caller's) reaches the attention as a dense tensor,
    exact under ``never``."""
    ref_model, model = _causal_lm("llama", "sdpa").eval(), _causal_lm("llama", "fp4attn").eval()
    model.load_state_dict(ref_model.state_dict())
    ids = torch.randint(1, 128, (2, 24))
    mask = torch.ones(24, 24, dtype=torch.bool).tril() & (torch.rand(2, 1, 24, 24) > 0.2)
    mask |= torch.eye(24, dtype=torch.bool)  # every query sees itself
    with torch.no_grad(), fp4_inductor.configure(policy="never"):
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           ref_model(input_ids=ids, attention_mask=mask).logits)
        report = fp4_inductor.explain(model, input_ids=ids, attention_mask=mask, eager=True)
    assert {s.mask for s in report.sites} == {"dense"}, str(report)


# ----------------------------------------------------------------- diffusers

diffusers = pytest.importorskip("diffusers")

FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                 axes_dims_rope=(8, 12, 12))
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=64)


def _diffusion_model(name):
    if name == "flux":
        n, text = 64, 16
        model = diffusers.FluxTransformer2DModel(**FLUX_TINY)
        inputs = dict(hidden_states=torch.randn(1, n, 16), encoder_hidden_states=torch.randn(1, text, 32),
                      pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]), img_ids=torch.randn(n, 3),
                      txt_ids=torch.zeros(text, 3), guidance=torch.tensor([3.5]), return_dict=False)
        return model.eval(), inputs, ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]
    model = diffusers.WanTransformer3DModel(**WAN_TINY)
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 8, 8), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 16, 32), return_dict=False)
    return model.eval(), inputs, ["blocks.0.attn1", "blocks.0.attn2"]


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_diffusers_processors_and_patch(name):
    from fp4_inductor.integrations.diffusers import use_fp4attn

    model, inputs, sites = _diffusion_model(name)
    with torch.no_grad():
        ref = model(**inputs)[0]
        routed = use_fp4attn(copy.deepcopy(model))
        with fp4_inductor.configure(policy="never"):
            assert torch.equal(routed(**inputs)[0], ref)
        report = fp4_inductor.explain(routed, **inputs, eager=True, **ALWAYS)
        assert [(s.name, s.path) for s in report.sites] == [(s, "fp8") for s in sites], str(report)
        with fp4_inductor.configure(**ALWAYS):
            assert cosine(routed(**inputs)[0], ref) > 0.999
            with fp4_inductor.patch():  # compiled with Inductor: routed by patch(), one graph
                assert torch._dynamo.explain(model)(**inputs).graph_break_count == 0
                if name == "wan":
                    return  # Inductor's compile of Wan: ~30 s of CI for what FLUX shows
                torch._dynamo.reset()
                out, calls = op_calls(torch.compile(model, backend="inductor"), **inputs)
    assert calls["fwd"] == len(sites)
    assert cosine(out[0], ref) > 0.999
