"""Masks with structure: what real models build reaches the op as a causal structure and a
key-padding vector (``patterns/masks.py``), never as a dense ``[.., Nq, Nk]`` tensor; rows
with no visible key get what eager gives them."""

import pytest
import torch
import torch.nn.functional as F
import transformers

import fp4_inductor
from fp4_inductor import config
from attention_checks import (assert_faults_rejected, assert_within_reference_error, fp64_copy, lowp_reference,
                              peaked_hf)
from helpers import cosine, fwd_inputs, op_calls, rel_l2

B, N = 2, 24
NK = 32  # the keys the op sees: N padded to a multiple of quantized.KEY_ALIGN, the padding masked
PAD = 5  # left padding of the second sequence
QK_GAIN = 5.0  # scores of std about 3 (attention_checks.peaked_hf)


def _causal_lm(name, attn, layers=2):
    torch.manual_seed(torch.initial_seed() % 2**31)
    kw = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation=attn)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**kw, sliding_window=8))


def _batch(padded: bool):
    ids = torch.randint(1, 128, (B, N))
    mask = torch.ones(B, N, dtype=torch.long)
    if padded:
        mask[1, :PAD] = 0
    return ids, mask


MODELS = [(m, a) for m in ("llama", "qwen2", "mistral") for a in ("sdpa", "eager")]


@pytest.mark.parametrize("padded", [False, True], ids=["ones", "left-padded"])
@pytest.mark.parametrize("name,attn", MODELS)
def test_hf_attention_mask_reaches_the_op_as_structure(name, attn, padded):
    model = _causal_lm(name, attn).eval()
    ids, mask = _batch(padded)
    report = fp4_inductor.explain(model, input_ids=ids, attention_mask=mask, policy="always")
    want = "window 8+padding" if name == "mistral" else "causal+padding"
    assert [s.mask for s in report.sites] == [want, want], str(report)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        with fp4_inductor.configure(policy="always"):
            out, calls = fwd_inputs(torch.compile(model, backend="fp4attn"), input_ids=ids, attention_mask=mask)
    assert len(calls) == 2
    for q8, k8, v_t, _, _, _, bias, *_ in calls:
        assert k8 == [B, 2, NK, 32] and v_t == [B, 2, 32, NK]  # K/V with Hkv heads: repeat_kv undone
        assert bias == [B, 1, 1, NK]  # the key-padding row, no [.., Nq, Nk] mask
    keep = mask.bool()
    assert cosine(out.logits[keep], ref[keep]) > 0.99
    assert not out.logits.isnan().any()


# transformers >= 5.25 sets module state inside each checkpointed attention (its hub-kernel
# registry); Dynamo runs such layers eagerly unless told the backward need not replay it.
HF_CHECKPOINTING = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
@HF_CHECKPOINTING
def test_hf_training_with_gradient_checkpointing(name):
    model = _causal_lm(name, "sdpa", layers=1).train()
    ids, mask = _batch(True)

    def step(fn):
        model.zero_grad()
        out = fn(input_ids=ids, attention_mask=mask).logits
        out[mask.bool()].float().pow(2).mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ref = step(model)
    got = {}
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable()
        torch._dynamo.reset()
        with fp4_inductor.configure(policy="always"):
            got[ckpt], calls = op_calls(step, torch.compile(model, backend="fp4attn"))
        assert calls["fwd"] >= 1 and calls["bwd"] == 1, calls
    model.gradient_checkpointing_disable()
    assert cosine(got[True], ref) >= 0.98
    # The recomputed forward quantizes as the first one did, but for codes that the two
    # compiled graphs' float rounding may flip (tests/test_capture.py's checkpointing test).
    assert cosine(got[True], got[False]) >= 0.9995


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padded"])
@HF_CHECKPOINTING
def test_hf_training_masks_keep_their_structure_under_checkpointing(padded):
    """Training without a cache: HF builds its mask once, outside the checkpointed layers
    (``masks.lift_mask_structures`` reads it there), and without an ``attention_mask`` it
    also compares packed-sequence ids derived from the positions (all one sequence when
    the positions are its own ramp).  Both still reach the op as structure, and so do
    position ids passed in (packed data, perhaps: document ids, ``tests/test_packed.py``).
    Loss gradients as eager's."""
    model = _causal_lm("llama", "sdpa").train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    ids, mask = _batch(padded)
    kwargs = {"input_ids": ids, **({"attention_mask": mask} if padded else {})}
    want = "causal+padding" if padded else "causal"
    report = fp4_inductor.explain(model, **kwargs, policy="always")
    assert [s.mask for s in report.sites] == [want, want], str(report)
    if not padded:
        packed = fp4_inductor.explain(model, **kwargs, position_ids=torch.arange(N).repeat(B, 1), policy="always")
        assert [s.mask for s in packed.sites] == ["causal+documents"] * 2, str(packed)

    def step(fn):
        model.zero_grad()
        out = fn(**kwargs).logits
        out[mask.bool()].float().pow(2).mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ref = step(model)
    backend, graphs = _rewritten_graphs(config.current().replace(policy="always"))
    torch._dynamo.reset()
    assert cosine(step(torch.compile(model, backend=backend)), ref) >= 0.98
    operands = [a for g in graphs for n in g.graph.nodes
                if n.target is torch.ops.higher_order.tag_activation_checkpoint for a in n.args[1:]]
    square = [a for a in operands if isinstance(a, torch.fx.Node) and a.meta["example_value"].shape[-2:] == (N, N)]
    assert len(operands) > 2 * 5 and not square, square  # the mask no body reads is not passed in
    torch._dynamo.reset()
    with fp4_inductor.configure(policy="always"):
        (got, shapes) = fwd_inputs(step, torch.compile(model, backend="fp4attn"))
    assert len(shapes) >= 2 and all(s[6] in ([], [B, 1, 1, NK]) for s in shapes), shapes  # no [.., N, N] bias
    assert cosine(got, ref) >= 0.98
    model.gradient_checkpointing_disable()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_left_padded(cache):
    """A compiled generate(): under policy="never" eager's greedy tokens; under "always" our
    ops, no more recompiles than "never", and the first step's logits (the prompt's, which
    every later token depends on) within twice the low-precision reference's error, a bound
    that rejects faulty attention.  (Later tokens may part from eager's where two logits
    are closer than the fp8 error.)  Peaked scores: QK_GAIN."""
    model = peaked_hf(_causal_lm("llama", "sdpa"), QK_GAIN).eval()
    ids, mask = _batch(True)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        exact = fp64_copy(model).generate(ids, **kw).logits[0]
        with lowp_reference():
            lowp = fp64_copy(model).generate(ids, **kw).logits[0]
    check = lambda out: assert_within_reference_error(out.logits[0], exact, lowp, 2.0, "first-step logits")
    frames = {}
    for policy in ("never", "always"):
        torch._dynamo.reset()
        counter = torch._dynamo.utils.counters
        counter.clear()
        forward = model.forward
        model.forward = torch.compile(forward, backend="fp4attn")
        try:
            with torch.no_grad(), fp4_inductor.configure(policy=policy):
                (out, calls) = op_calls(lambda: model.generate(ids, **kw))
                if policy == "always":
                    check(out)
                    assert_faults_rejected(lambda: model.generate(ids, **kw), check)
        finally:
            model.forward = forward
        frames[policy] = counter["stats"]["unique_graphs"]
        if policy == "never":
            assert torch.equal(out.sequences, ref.sequences) and calls["fwd"] == 0
        else:
            assert calls["fwd"] > 0 and out.sequences.shape == ref.sequences.shape
    assert frames["always"] <= frames["never"], frames


class TrilMasked(torch.nn.Module):
    """nanoGPT without flash: a lower-triangular mask built in forward, filled with -inf
    (or, with ``sdpa``, passed to SDPA as a boolean mask, as HF models do when traced)."""

    def __init__(self, window=0, sdpa=False):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)
        self.window, self.sdpa = window, sdpa

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 32).permute(2, 0, 3, 1, 4)
        ones = torch.ones(n, n, dtype=torch.bool, device=x.device)
        keep = torch.tril(ones)
        if self.window:
            keep = keep & ~torch.tril(ones, diagonal=-self.window)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            att = (q @ k.transpose(-2, -1)) * 32**-0.5
            out = F.softmax(att.masked_fill(~keep, float("-inf")), dim=-1) @ v
        return out.transpose(1, 2).reshape(b, n, 64)


@pytest.mark.parametrize("window", [0, 7])
def test_handwritten_tril_mask_is_causal(window):
    module = TrilMasked(window).eval()
    x = torch.randn(B, 48, 64)  # a multiple of quantized.KEY_ALIGN: no key-padding row either
    report = fp4_inductor.explain(module, x, policy="always")
    assert [s.mask for s in report.sites] == [f"window {window}" if window else "causal"], str(report)
    torch._dynamo.reset()
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = fwd_inputs(torch.compile(module, backend="fp4attn"), x)
    assert calls and calls[0][6] == []  # no bias at all
    assert cosine(out, module(x)) > 0.99


def _rewritten_graphs(options):
    """A backend that runs the rewrite and then the rewritten torch-level graph as it is,
    and the graphs it saw."""
    from fp4_inductor.compiler import rewrite

    graphs = []

    def backend(gm, example_inputs):
        rewrite(gm, options)
        graphs.append(gm)
        return gm.forward

    return backend, graphs


@pytest.mark.parametrize("site", ["llama-eager", "tril-softmax", "tril-sdpa"])
def test_bf16_site_runs_its_causal_mask_as_is_causal(site):
    """A site left on BF16 whose masks are the causal structure alone (HF builds a dense
    [B, 1, N, N] mask under tracing) runs SDPA's is_causal with no mask tensor built:
    the flash/cuDNN kernels skip the masked half rather than read the mask per score.
    Output and gradients as eager's, through the rewritten graph and through Inductor."""
    if site == "llama-eager":
        model, args, kwargs = _causal_lm("llama", "eager").train(), (), {"input_ids": _batch(False)[0]}
    else:
        model, args, kwargs = TrilMasked(sdpa=site == "tril-sdpa").train(), (torch.randn(B, N, 64),), {}
    bf16 = dict(overrides=(("*", "bf16"),))
    with fp4_inductor.configure(**bf16):
        report = fp4_inductor.explain(model, *args, **kwargs)
    assert all(s.path == "bf16" and s.mask == "causal" and s.reason.endswith("causal mask run as is_causal")
               for s in report.sites) and report.sites, str(report)

    def loss_and_grads(fn):
        model.zero_grad()
        out = fn(*args, **kwargs)
        out = out if isinstance(out, torch.Tensor) else out.logits
        out.pow(2).mean().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ref_out, ref_grads = loss_and_grads(model)
    backend, graphs = _rewritten_graphs(config.current().replace(**bf16))
    torch._dynamo.reset()
    out, got = loss_and_grads(torch.compile(model, backend=backend))
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum(n.target is fp4_inductor.runtime.causal_sdpa for n in calls) == len(report.sites)
    square = [n for n in calls if n.users and isinstance(n.meta.get("example_value"), torch.Tensor)
              and n.meta["example_value"].shape[-2:] == (N, N)]
    assert not square, square  # neither the mask nor the scores are used (a dead node goes in Inductor's DCE)
    assert rel_l2(out, ref_out) < 1e-5 and rel_l2(got, ref_grads) < 1e-4
    torch._dynamo.reset()
    with fp4_inductor.configure(**bf16):
        out, got = loss_and_grads(torch.compile(model, backend="fp4attn"))
    assert rel_l2(out, ref_out) < 1e-5 and rel_l2(got, ref_grads) < 1e-4


@pytest.mark.gpu
def test_bf16_causal_mask_reaches_sdpa_without_a_bias_on_gpu():
    """On CUDA the rewritten BF16 site is SDPA's own causal kernel: no bias goes to the
    fused attention op, which under the dense mask reads one per score (cuDNN's bias path
    in the H200's Llama profile)."""
    from torch.profiler import ProfilerActivity, profile

    module = TrilMasked(sdpa=True).cuda().to(torch.bfloat16).eval()
    x = torch.randn(B, 256, 64, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), fp4_inductor.configure(overrides=(("*", "bf16"),)):
        compiled = torch.compile(module, backend="fp4attn")
        compiled(x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = compiled(x)
    assert rel_l2(out, module(x)) < 0.01
    fused = [(e.name, e.input_shapes) for e in prof.events() if e.name in (
        "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention")]
    # flash takes no bias; cuDNN and the efficient kernel take it fourth
    assert fused and all("flash" in name or len(shapes) < 4 or shapes[3] == [] for name, shapes in fused), fused
