"""Golden text of the rewritten Dynamo graphs (expecttest: EXPECTTEST_ACCEPT=1 updates)."""

import pytest
import torch
import torch.fx as fx

from fp4_inductor.attention import lowp_attention
from fp4_inductor.runtime import combine_masks
from fp4_inductor.compiler import rewrite
from fp4_inductor.config import Options

# A test-only package: where it is absent (a GPU host without the test extra) the module
# skips with this reason instead of failing to import.
expecttest = pytest.importorskip("expecttest", reason="expecttest is not installed (pip install -e '.[test]')")


def rewritten_calls(fn, *args, **kwargs) -> str:
    """The calls the rewrite inserted, with the producers of their arguments."""
    graphs = []

    def capture(gm, example_inputs):
        rewrite(gm, Options(policy="always"))
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture)(*args, **kwargs)
    lines = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (lowp_attention, combine_masks):
                rendered = fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
                lines.append(f"{node.name} = {node.target.__name__}{rendered}")
    return "\n".join(lines)


class TestGolden(expecttest.TestCase):
    def test_sdpa_rewrite(self):
        def fn(x, w):
            q, k, v = (x @ w).view(2, 64, 3, 4, 64).permute(2, 0, 3, 1, 4).unbind(0)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        text = rewritten_calls(fn, torch.randn(2, 64, 256), torch.randn(256, 768))
        self.assertExpectedInline(text, """lowp_attention = lowp_attention(('q', 'k', 'v'), {'attn_mask': None, 'scale': None, 'is_causal': True, 'fmt': 'fp8', 'p_mode': None})""")

    def test_llama_eager_rewrite(self):
        import transformers
        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, attn_implementation="eager",
        )
        model = transformers.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            text = rewritten_calls(model, input_ids=torch.randint(0, 128, (1, 32)))
        self.assertExpectedInline(text, """lowp_attention = lowp_attention(('q_embed', 'keys', 'values'), {'attn_mask': None, 'scale': 0.125, 'is_causal': True, 'fmt': 'fp8', 'p_mode': None, 'diagonal': 0, 'window': 0, 'empty_rows': 'mean'})""")
