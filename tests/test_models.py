"""Unmodified HuggingFace models (random init, eager and sdpa attention) through fp4attn."""

import pytest
import torch

import fp4_inductor
from helpers import cosine, op_calls

transformers = pytest.importorskip("transformers")

SEQ = 64


def _model(name, attn):
    torch.manual_seed(torch.initial_seed() % 2**31)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
        )
        return transformers.LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 256, (2, SEQ))}
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=256, n_embd=256, n_layer=2, n_head=4, n_positions=128, attn_implementation=attn,
            bos_token_id=0, eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 256, (2, SEQ))}
    if name == "bert":
        cfg = transformers.BertConfig(
            vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=512, attn_implementation=attn,
        )
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, 40:] = 0  # right padding in the second sequence
        return transformers.BertModel(cfg), {"input_ids": torch.randint(0, 256, (2, SEQ)), "attention_mask": mask}
    cfg = transformers.ViTConfig(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
        image_size=64, patch_size=8, attn_implementation=attn,
    )
    return transformers.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 64, 64)}


MODELS = [(m, a) for m in ("llama", "gpt2", "bert", "vit") for a in ("eager", "sdpa")]


@pytest.mark.parametrize("name, attn", MODELS)
def test_model_inference(name, attn):
    model, inputs = _model(name, attn)
    model.eval()
    report = fp4_inductor.explain(model, **inputs, policy="always")
    assert len(report.sites) == 2 and all(s.path == "fp8" for s in report.sites), str(report)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(**inputs)[0]
        with fp4_inductor.configure(policy="always"):
            out, calls = op_calls(torch.compile(model, backend="fp4attn"), **inputs)
    assert calls["fwd"] == 2
    assert cosine(out[0], ref) > 0.99


@pytest.mark.parametrize("name, attn", MODELS)
def test_model_training_gradients(name, attn):
    model, inputs = _model(name, attn)
    model.train()
    for mod in model.modules():  # dropout off: the comparison is about attention numerics
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0

    def loss_and_grads(fn):
        model.zero_grad()
        out = fn(**inputs)[0]
        out.float().pow(2).mean().backward()
        return out.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]

    ref_out, ref_grads = loss_and_grads(model)
    with fp4_inductor.configure(policy="always"):
        (out, got), calls = op_calls(loss_and_grads, torch.compile(model, backend="fp4attn"))
    assert calls["fwd"] == 2 and calls["bwd"] == 2
    assert cosine(out, ref_out) > 0.99
    flat = lambda gs: torch.cat([g.flatten() for g in gs])
    assert cosine(flat(got), flat(ref_grads)) > 0.98
