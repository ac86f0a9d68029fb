"""Unmodified HuggingFace models (random init, eager and sdpa attention) through fp4attn.

Query and key projections are scaled up so that scores are peaked (``peaked_hf``).  Errors are bounded by a multiple of the low-precision
reference's (tests/attention_checks.py), and every test checks that its bound rejects
attention computed with a halved scale, without its mask, or as zeros."""

import pytest
import torch
import transformers

import fp4_inductor
from attention_checks import (assert_faults_rejected, assert_within_reference_error, fp64_copy, lowp_reference,
                              peaked_hf)
from helpers import op_calls

SEQ = 64
# Scores' std at this factor: about 3 (peaked, not one-hot).
QK_GAIN = 5.0
# Our error against fp64 over the low-precision reference's: 1.0-1.2 measured (outputs and
# gradients, all four models); the faults' outputs 12-52.
K_OUT, K_GRAD = 2.0, 2.0


def _model(name, attn):
    torch.manual_seed(torch.initial_seed() % 2**31)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
        )
        model, inputs = transformers.LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 256, (2, SEQ))}
    elif name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=256, n_embd=256, n_layer=2, n_head=4, n_positions=128, attn_implementation=attn,
            bos_token_id=0, eos_token_id=0,
        )
        model, inputs = transformers.GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 256, (2, SEQ))}
    elif name == "bert":
        cfg = transformers.BertConfig(
            vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=512, attn_implementation=attn,
        )
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, 40:] = 0  # right padding in the second sequence
        model = transformers.BertModel(cfg)
        inputs = {"input_ids": torch.randint(0, 256, (2, SEQ)), "attention_mask": mask}
    else:
        cfg = transformers.ViTConfig(
            hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
            image_size=64, patch_size=8, attn_implementation=attn,
        )
        model, inputs = transformers.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 64, 64)}
    return peaked_hf(model, QK_GAIN), inputs


def _references(name, attn, model, run):
    """``run`` on fp64 copies: ``model`` itself (exact) and the same weights with SDPA
    attention in low precision."""
    exact = run(fp64_copy(model))
    lowp_model = fp64_copy(model)
    lowp_model.set_attn_implementation("sdpa")
    with lowp_reference():
        lowp = run(lowp_model)
    return exact, lowp


def _double(inputs):
    return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


def _faults(name):
    """ViT has no mask: its ignored-mask fault would test nothing of the model's."""
    return ("half_scale", "zero_output") if name == "vit" else ("half_scale", "mask_ignored", "zero_output")


MODELS = [(m, a) for m in ("llama", "gpt2", "bert", "vit") for a in ("eager", "sdpa")]


@pytest.mark.parametrize("name, attn", MODELS)
def test_model_inference(name, attn):
    model, inputs = _model(name, attn)
    model.eval()
    report = fp4_inductor.explain(model, **inputs, policy="always")
    assert len(report.sites) == 2 and all(s.path == "fp8" for s in report.sites), str(report)
    torch._dynamo.reset()
    with torch.no_grad():
        exact, lowp = _references(name, attn, model, lambda m: m(**_double(inputs))[0])
        with fp4_inductor.configure(policy="always"):
            compiled = torch.compile(model, backend="fp4attn")
            out, calls = op_calls(compiled, **inputs)
            assert calls["fwd"] == 2
            check = lambda out: assert_within_reference_error(out[0], exact, lowp, K_OUT)
            check(out)
            assert_faults_rejected(lambda: compiled(**inputs), check, _faults(name))


@pytest.mark.parametrize("name, attn", MODELS)
def test_model_training_gradients(name, attn):
    model, inputs = _model(name, attn)
    model.train()
    for mod in model.modules():  # dropout off: the comparison is about attention numerics
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0

    def loss_and_grads(fn, model, inputs):
        model.zero_grad()
        out = fn(**inputs)[0]
        out.float().pow(2).mean().backward()
        # (BERT's pooler gets no gradient in eager, zeros compiled)
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                           for p in model.parameters()])
        return out.detach(), grads

    exact, lowp = _references(name, attn, model, lambda m: loss_and_grads(m, m, _double(inputs)))
    compiled = torch.compile(model, backend="fp4attn")

    check_grads = lambda result: assert_within_reference_error(result[1], exact[1], lowp[1], K_GRAD, "gradients")
    with fp4_inductor.configure(policy="always"):
        result, calls = op_calls(loss_and_grads, compiled, model, inputs)
        assert calls["fwd"] == 2 and calls["bwd"] == 2
        assert_within_reference_error(result[0], exact[0], lowp[0], K_OUT)
        check_grads(result)
        # The gradients' bound alone rejects the faults (the outputs' is checked above).
        assert_faults_rejected(lambda: loss_and_grads(compiled, model, inputs), check_grads, _faults(name))
