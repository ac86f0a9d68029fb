"""Packed sequences: document masks reach the op as document ids (``documents.py``,
``patterns/packed.py``), flex_attention's block masks are read from their mask_mod
(``patterns/flex.py``), and a sweep over lengths compiles no more graphs than BF16."""

import pytest
import torch
import torch.nn.functional as F

import fp4_inductor
from fp4_inductor import documents as D
from fp4_inductor.attention import lowp_attention
from helpers import compiled_graphs, cosine, documents_of, fwd_inputs, rel_l2

LENGTHS = ((70, 20, 110, 56), (40, 130, 86))  # 4 and 3 documents of unequal lengths, 256 tokens a row


def _dense(ids, causal):
    keep = D.same_document(ids, ids)
    return keep & torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril() if causal else keep


@pytest.mark.parametrize("causal", [False, True])
def test_packed_batch_equals_its_documents_one_by_one(causal, fresh_seed):
    """Outputs and gradients of a packed batch against eager SDPA run on each document
    alone, and the op's own result with the same mask as a dense tensor (the quantization
    spans the packed row either way).  That dense mask arrives as an additive bias, and a
    biased score is rounded to float32 before its P code (the kernels' FMA) while an
    unbiased one is rounded once from the exact product: a score on a code boundary may
    take the neighbouring code, about one row in 2048 per run, nothing more."""
    ids = documents_of(LENGTHS)
    b, n = ids.shape
    q, k, v = (torch.randn(b, 4, n, 64, requires_grad=True) for _ in range(3))
    k2, v2 = (t.detach()[:, :2].requires_grad_() for t in (k, v))  # GQA
    out = lowp_attention(q, k2, v2, is_causal=causal, q_documents=ids, k_documents=ids)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k2, v2), dout)
    dense = lowp_attention(q, k2, v2, attn_mask=_dense(ids, causal))
    rows_differing = (out != dense).any(dim=-1).sum().item()
    assert rows_differing <= 4 and rel_l2(out, dense) < 1e-3, f"seed {fresh_seed}"
    for got, want in zip(grads, torch.autograd.grad(dense, (q, k2, v2), dout)):
        assert rel_l2(got, want) < 5e-3, f"seed {fresh_seed}"
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            part = slice(start, start + length)
            start += length
            pq, pk, pv = (t.detach()[row:row + 1, :, part].requires_grad_() for t in (q, k2, v2))
            ref = F.scaled_dot_product_attention(pq, pk, pv, is_causal=causal, enable_gqa=True)
            ref_grads = torch.autograd.grad(ref, (pq, pk, pv), dout[row:row + 1, :, part])
            assert cosine(out[row:row + 1, :, part], ref) > 0.998, f"seed {fresh_seed}"
            for got, want in zip(grads, ref_grads):
                assert cosine(got[row:row + 1, :, part], want) > 0.99, f"seed {fresh_seed}"


def test_document_ranges_hold_every_visible_key(fresh_seed):
    """``key_ranges``: every key of a row tile's documents inside [lo, hi), the whole tiles
    wholly of its one document; ``query_ranges`` the same for key tiles; all keys for ids
    out of order."""
    ids = documents_of(LENGTHS)
    same = D.same_document(ids, ids)[:, 0]
    for rows, block in ((64, 128), (128, 128), (64, 32)):
        ranges = D.key_ranges(ids, ids, block, rows)
        for b in range(ids.shape[0]):
            for t, (lo, hi, full_lo, full_hi) in enumerate(ranges[b].tolist()):
                seen = same[b, t * rows:(t + 1) * rows].any(0).nonzero().squeeze(1)
                assert lo % block == 0 and lo <= seen.min() and seen.max() < hi
                assert same[b, t * rows:(t + 1) * rows, full_lo:full_hi].all()
        qr = D.query_ranges(ids, ids, block)
        for b in range(ids.shape[0]):
            for t, (lo, hi) in enumerate(qr[b].tolist()):
                seen = same[b, :, t * block:(t + 1) * block].any(1).nonzero().squeeze(1)
                assert lo <= seen.min() and seen.max() < hi
    shuffled = ids[:, torch.randperm(ids.shape[1])]
    assert (D.key_ranges(shuffled, shuffled, 128)[..., :2] == torch.tensor([0, ids.shape[1]])).all()


class DocumentMasked(torch.nn.Module):
    """nanoGPT-style packing: ``doc[:, None] == doc[None, :]`` and a causal ``tril``,
    filled with -inf before the softmax."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)

    def forward(self, x, doc):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 32).permute(2, 0, 3, 1, 4)
        keep = (doc[:, None] == doc[None, :]) & torch.tril(torch.ones(n, n, dtype=torch.bool))
        att = (q @ k.transpose(-2, -1)) * 32**-0.5
        out = F.softmax(att.masked_fill(~keep, float("-inf")), dim=-1) @ v
        return out.transpose(1, 2).reshape(b, n, 64)


def test_handwritten_document_mask_is_structure(fresh_seed):
    module = DocumentMasked()
    x, doc = torch.randn(2, 256, 64), documents_of(LENGTHS[:1])[0]
    report = fp4_inductor.explain(module, x, doc, policy="always")
    assert [s.mask for s in report.sites] == ["causal+documents"], str(report)
    torch._dynamo.reset()
    with torch.no_grad(), fp4_inductor.configure(policy="always"):
        out, calls = fwd_inputs(torch.compile(module, backend="fp4attn"), x, doc)
    assert calls and calls[0][6] == [] and calls[0][-1] == [2, 256], calls  # no bias; [B, N] key ids
    assert cosine(out, module(x, doc)) > 0.998, f"seed {fresh_seed}"


def test_hybrid_path_not_offered_with_documents(fresh_seed):
    """No BF16 backward takes document ids: an override to the hybrid training path keeps
    BF16 at a packed site and says why; the function itself refuses the combination."""
    module = DocumentMasked()
    x, doc = torch.randn(2, 256, 64, requires_grad=True), documents_of(LENGTHS[:1])[0]
    with fp4_inductor.configure(overrides={"*": "fp8+bf16bwd"}):
        report = fp4_inductor.explain(module, x, doc)
    assert [(s.mask, s.path) for s in report.sites] == [("causal+documents", "bf16")], str(report)
    assert "no BF16 backward" in report.sites[0].reason, str(report)
    q = torch.randn(1, 2, 64, 32)
    ids = torch.arange(64).div(20, rounding_mode="floor")[None]
    with pytest.raises(ValueError, match="document"):
        lowp_attention(q, q, q, is_causal=True, backward="bf16", q_documents=ids, k_documents=ids)


def _causal_lm(name):
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_hf_trains_on_a_flattened_batch(name, fresh_seed):
    """``DataCollatorWithFlattening``'s batch: one row of documents, positions restarting at
    each.  HF builds a block-diagonal causal mask from the positions; the op gets the
    document ids instead, and the loss gradients are eager's."""
    model = _causal_lm(name).train()
    lengths = LENGTHS[1]
    ids = torch.randint(1, 128, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    report = fp4_inductor.explain(model, input_ids=ids, position_ids=pos, policy="always")
    assert [s.mask for s in report.sites] == ["causal+documents"] * 2, str(report)

    def step(fn):
        model.zero_grad()
        out = fn(input_ids=ids, position_ids=pos).logits
        out.float().pow(2).mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ref = step(model)
    torch._dynamo.reset()
    with fp4_inductor.configure(policy="always"):
        got, calls = fwd_inputs(step, torch.compile(model, backend="fp4attn"))
    assert len(calls) == 2 and all(c[6] == [] for c in calls), calls  # no [.., N, N] bias
    assert cosine(got, ref) >= 0.99, f"seed {fresh_seed}"


def _flex():
    return pytest.importorskip("torch.nn.attention.flex_attention")


def _mask_mods(flex, doc):
    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    def causal(b, h, q, kv):
        return q >= kv

    def window(b, h, q, kv):
        return q - kv < 48

    def prefix(b, h, q, kv):
        return kv < 32

    return {"causal+documents": flex.and_masks(document, causal), "window 48": flex.and_masks(causal, window),
            "documents": document, "mask_mod": flex.or_masks(prefix, causal)}


class FlexAttention(torch.nn.Module):
    def __init__(self, attend, block_mask, score_mod=None):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.attend, self.block_mask, self.score_mod = attend, block_mask, score_mod

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.attend(q, k[:, :2], v[:, :2], score_mod=self.score_mod, block_mask=self.block_mask,
                           enable_gqa=True)


@pytest.mark.parametrize("wrapped", [False, True], ids=["flex", "compiled-flex"])
def test_flex_attention_block_masks_run_our_ops(wrapped, fresh_seed):
    """Document, causal and sliding-window mask_mods run the op, against eager flex; a
    prefix-LM ``or_masks`` and a score_mod stay flex, saying why.  ``compiled-flex``: the
    model calls a ``torch.compile``'d flex_attention, as fused-kernel users do."""
    flex = _flex()
    doc = documents_of(LENGTHS[:1])[0]
    x = torch.randn(2, 4, 256, 32)
    attend = torch.compile(flex.flex_attention) if wrapped else flex.flex_attention
    for want, mask_mod in _mask_mods(flex, doc).items():
        module = FlexAttention(attend, flex.create_block_mask(mask_mod, None, None, 256, 256, device="cpu")).eval()
        with torch.no_grad():  # eager flex takes no gradient on the CPU (test_flex_attention_trains)
            report = fp4_inductor.explain(module, x, policy="always")
        [site] = report.sites
        assert site.kind == "flex" and site.mask == want, str(report)
        assert (site.path == "bf16") == (want == "mask_mod"), str(report)
        torch._dynamo.reset()
        with torch.no_grad(), fp4_inductor.configure(policy="always"):
            out = torch.compile(module, backend="fp4attn")(x)
            ref = FlexAttention(flex.flex_attention, module.block_mask).eval()
            ref.load_state_dict(module.state_dict())
            ref = ref(x)
        assert cosine(out, ref) > (0.9999 if want == "mask_mod" else 0.998), (want, fresh_seed)
    scaled = FlexAttention(attend, module.block_mask, score_mod=lambda s, b, h, q, kv: s * 2)
    with torch.no_grad():
        [site] = fp4_inductor.explain(scaled, x, policy="always").sites
    assert site.path == "bf16" and "score_mod" in site.reason


def test_flex_attention_trains(monkeypatch, fresh_seed):
    """Gradients through a captured flex_attention (document + causal, GQA) as eager SDPA's
    with the same mask.  Eager flex refuses backward on the CPU in its argument checks,
    which Dynamo traces: switched off, since the rewritten graph never runs flex."""
    flex = _flex()
    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    doc = documents_of(LENGTHS[:1])[0]
    block_mask = flex.create_block_mask(_mask_mods(flex, doc)["causal+documents"], None, None, 256, 256,
                                        device="cpu")
    module = FlexAttention(flex.flex_attention, block_mask)
    dense = _dense(doc[None], True)
    ref = FlexAttention(lambda q, k, v, **_: F.scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                                                              enable_gqa=True), None)
    ref.load_state_dict(module.state_dict())
    x = torch.randn(2, 4, 256, 32)

    def step(model, fn):
        model.zero_grad()
        out = fn(x)
        out.pow(2).mean().backward()
        return out.detach(), model.qkv.weight.grad.clone()

    want_out, want_grad = step(ref, ref)
    torch._dynamo.reset()
    with fp4_inductor.configure(policy="always"):
        out, grad = step(module, torch.compile(module, backend="fp4attn"))
    assert cosine(out, want_out) > 0.998 and cosine(grad, want_grad) > 0.99, f"seed {fresh_seed}"


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "key-padding"])
def test_length_sweep_compiles_no_more_graphs_than_bf16(padded):
    """Lengths that are multiples of 16 and others, under ``dynamic=None``: the key
    alignment (``quantized.align_keys``) adds no guard on ``(-N) % 16``, so low precision
    compiles as many graphs as BF16 (the first length static, one dynamic graph after)."""

    def attend(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :] if padded else None)

    def sweep(compiled):
        with torch.no_grad():
            for n in (40, 48, 57, 64, 80, 99):
                q, k, v = (torch.randn(1, 2, n, 32) for _ in range(3))
                keep = torch.rand(1, n) > 0.2
                keep[:, 0] = True
                out = compiled(q, k, v, keep)
                assert out.shape == q.shape and not out.isnan().any()

    graphs = {policy: compiled_graphs(attend, policy, sweep) for policy in ("never", "always")}
    assert graphs["always"] == graphs["never"], graphs


@pytest.mark.parametrize("mask", ["causal+documents", "documents", "window 4096+documents", "causal+documents+padding"])
def test_auto_keeps_bf16_for_documents_until_measured(mask):
    """The shipped H200 table has no rate for document structure (a packed row does a
    fraction of the causal work): ``auto`` keeps BF16 and says so."""
    from fp4_inductor import policy as P

    shape = P.SiteShape(4, 16, 8, 16384, 16384, 128, causal=mask != "documents", training=True, mask=mask)
    decision = P.cost_model_decision(shape, "fp8", P.table_for("NVIDIA H200"), "NVIDIA H200")
    reason = decision.reason
    assert decision.path == "bf16" and "documents" in reason and "not measured on this GPU" in reason, reason


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_triton_kernels_with_documents_on_gpu(causal, fresh_seed):
    """The forward and backward kernels on the GPU, compiled by ptxas, with packed documents
    long enough that most key tiles are skipped: the reference's row references, the
    backward rules of ``bwd_checks``."""
    from bwd_checks import check, operands, run
    from helpers import quantized_operands
    from fp4_inductor import reference as R
    from fp4_inductor.kernels.triton import attention_fwd

    ids = documents_of(((700, 1300, 500, 1596), (4096,)))
    structure = {"q_documents": ids, "k_documents": ids}
    ops, _ = quantized_operands(2, 4, 2, 4096, 4096, 128, "direct")
    ref_o, _, ref_r = R.attention_forward(*ops, None, causal, "direct", torch.float32, **structure)
    dev = [t.cuda() for t in ops]
    out = torch.empty(2, 4096, 4, 128, device="cuda").transpose(1, 2)
    lse, row_ref = (torch.empty(2, 4, 4096, device="cuda") for _ in range(2))
    attention_fwd.attention_forward(*dev, None, causal, "direct", out, lse, row_ref,
                                    **{k: t.cuda() for k, t in structure.items()})
    assert torch.equal(row_ref.cpu(), ref_r), f"seed {fresh_seed}"
    assert rel_l2(out.cpu(), ref_o) < 1e-3, f"seed {fresh_seed}"
    bwd = operands(1, 2, 1, 1500, 1500, 64, "direct", causal, **{k: t[:1, :1500] for k, t in structure.items()})
    grads, dumps = run(bwd, causal, "direct", **{k: t[:1, :1500] for k, t in structure.items()})
    check(bwd, causal, "direct", grads, dumps, **{k: t[:1, :1500] for k, t in structure.items()})
