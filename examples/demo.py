"""Compile a small Llama-style model with backend="fp4attn" and compare it with eager.

On a CPU the low-precision path is the reference emulation (slow, exact numerics of the
kernels); on an H200 it runs the FP8 kernels and the script also times both.
"""

from __future__ import annotations

import time

import torch

import fp4_inductor


class Block(torch.nn.Module):
    """A pre-norm causal transformer block (used when transformers is not installed)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def build_model(device: torch.device, dtype: torch.dtype):
    """(forward function, vocabulary size): an HF Llama with random weights if
    transformers is installed, else a stack of built-in blocks."""
    big = device.type == "cuda"
    hidden, layers, heads, kv_heads = (2048, 4, 16, 4) if big else (512, 2, 8, 4)
    vocab = 32000 if big else 1024
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), *(Block(hidden, heads) for _ in range(layers)))
        model = model.to(device, dtype).eval()
        return model, vocab
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    return (lambda tokens: model(input_ids=tokens).logits), vocab


def timed(fn, *args, repeats: int = 10) -> float:
    fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    forward, vocab = build_model(device, dtype)
    tokens = torch.randint(0, vocab, (2, 4096 if device.type == "cuda" else 256), device=device)

    # "always": low precision wherever supported (on CPU the reference emulation), so the
    # demo shows the path even where the cost model would keep BF16.
    with fp4_inductor.configure(policy="always"), torch.no_grad():
        print(fp4_inductor.explain(forward, tokens))
        torch._dynamo.reset()
        compiled = torch.compile(forward, backend="fp4attn")
        out = compiled(tokens).float()
        ref = forward(tokens).float()
    err = (out - ref).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    print(f"\nlogits vs eager: max abs error {err:.4f}, cosine {cos:.5f}")
    if device.type == "cuda":
        with torch.no_grad():
            eager_ms, ours_ms = timed(forward, tokens), timed(compiled, tokens)
        print(f"{torch.cuda.get_device_name()}: eager {eager_ms:.2f} ms, fp4attn {ours_ms:.2f} ms")


if __name__ == "__main__":
    main()
