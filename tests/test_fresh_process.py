"""Every path a site can take, as a user first meets it: a fresh process, cold caches,
``fullgraph=True``.  Each case runs in its own interpreter, since a cache filled by an
earlier call (an eager run, ``explain``, another path) hides a first compile that fails:
the hybrid training path once did, and its failure sent the whole model to eager.

Per case: one graph, our ops called as the path implies (forward, and in training the
backward it names), no fallback logged, and the result close to eager SDPA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    import torch.nn.functional as Fn
    from torch.profiler import ProfilerActivity, profile

    path, mode, entry, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    training = mode == "train"
    fallbacks = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                fallbacks.append(record.getMessage())

    logging.getLogger("fp4_inductor").addHandler(Collect())
    import fp4_inductor  # after the handler: nothing of ours has run before this line

    torch.manual_seed(seed)
    if entry == "llama":  # the model a user reported the hybrid's failure on
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                       max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(cfg).train(training)
        ids = torch.randint(0, 96, (2, 80))
        def run(m):
            return m(ids).logits
        leaves = [p for p in model.parameters() if p.requires_grad]
    else:
        def attention(attend):
            return lambda q, k, v: attend(q, k, v, is_causal=True, enable_gqa=True)
        model = attention(Fn.scaled_dot_product_attention if entry == "sdpa" else fp4_inductor.scaled_dot_product_attention)
        q, k, v = (torch.randn(2, h, 80, 32, requires_grad=training) for h in (4, 2, 2))
        def run(m):
            return m(q, k, v)
        leaves = [q, k, v]

    dout = []
    def grad_out(out):  # one fixed random output gradient for every run
        if not dout:
            dout.append(torch.randn_like(out))
        return dout[0]

    def step(m):
        for t in leaves:
            t.grad = None
        with torch.set_grad_enabled(training):
            out = run(m)
            if training:
                out.backward(grad_out(out))
        return out.detach(), [t.grad.clone() for t in leaves] if training else []

    with fp4_inductor.configure(overrides={"*": path}):
        with fp4_inductor.configure(policy="never"):  # SDPA itself, eagerly: nothing of ours runs
            sdpa_out, sdpa_grads = step(model)
        compiled = model if entry == "dropin-eager" else torch.compile(model, backend="fp4attn", fullgraph=True)
        got_out, got_grads = step(compiled)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(compiled)
        # the same numerics eagerly, only now that the compiled path has run
        emulated = step(attention(fp4_inductor.scaled_dot_product_attention)) if entry != "llama" else None

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    ops = sorted({e.name for e in prof.events() if e.name.startswith("fp4attn::")})
    print(json.dumps({"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "ops": ops,
                      "fallbacks": fallbacks, "out": rel(got_out, sdpa_out),
                      "grads": max((rel(g, r) for g, r in zip(got_grads, sdpa_grads)), default=0.0),
                      "out_vs_eager": emulated and rel(got_out, emulated[0]),
                      "grads_vs_eager": emulated and max((rel(g, r) for g, r in zip(got_grads, emulated[1])), default=0.0)}))
    """
)

# (path, inference or training, entry) -> the fp4attn ops a call of it runs
CASES = {
    ("bf16", "infer", "sdpa"): set(),
    ("fp8", "infer", "sdpa"): {"fp4attn::fwd"},
    ("fp4", "infer", "sdpa"): {"fp4attn::fwd"},
    ("bf16", "train", "sdpa"): set(),
    ("fp8", "train", "sdpa"): {"fp4attn::fwd", "fp4attn::bwd"},
    ("fp8+bf16bwd", "train", "sdpa"): {"fp4attn::fwd", "fp4attn::bf16_bwd"},
    ("fp4", "train", "sdpa"): {"fp4attn::fwd", "fp4attn::bwd"},
    ("fp8+bf16bwd", "train", "llama"): {"fp4attn::fwd", "fp4attn::bf16_bwd"},
    ("fp8", "train", "dropin"): {"fp4attn::fwd", "fp4attn::bwd"},
    ("fp8", "train", "dropin-eager"): {"fp4attn::fwd", "fp4attn::bwd"},
}
# Against SDPA, a bound no path near its measured error fails but a broken one does (fp4's
# Direct-P is coarse at N = 80, D = 32: up to ~0.4); BF16 paths are SDPA itself.  Against
# the same path run eagerly (the drop-in on the CPU emulation), the numbers agree.
TOLERANCE = {"bf16": 1e-6, "fp8": 0.1, "fp8+bf16bwd": 0.1, "fp4": 0.6}
SAME_NUMERICS = 1e-4


@pytest.mark.parametrize("path,mode,entry", list(CASES), ids=["-".join(c) for c in CASES])
def test_path_compiles_in_a_fresh_process(path, mode, entry, tmp_path, fresh_seed):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               FP4ATTN_CACHE_DIR=str(tmp_path / "fp4attn"), FP4ATTN_POLICY="auto", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT, path, mode, entry, str(fresh_seed)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["fallbacks"] == []
    assert result["graphs"] == (0 if entry == "dropin-eager" else 1)
    assert set(result["ops"]) >= CASES[path, mode, entry], result["ops"]
    if not CASES[path, mode, entry]:
        assert not {"fp4attn::fwd", "fp4attn::bwd", "fp4attn::bf16_bwd"} & set(result["ops"]), result["ops"]
    assert result["out"] <= TOLERANCE[path] and result["grads"] <= TOLERANCE[path], result
    if entry != "llama":
        assert result["out_vs_eager"] <= SAME_NUMERICS and result["grads_vs_eager"] <= SAME_NUMERICS, result
