"""A site whose rewritten graph fails to compile is left to SDPA, the rest of the model is
compiled all the same, and the log and ``explain`` say why: never a silent drop of the
whole frame to eager (what a backend exception does), never a ``fullgraph`` failure."""

import logging
import math

import torch

import fp4_inductor
from fp4_inductor import attention
from fp4_inductor.config import HYBRID
from helpers import rel_l2


def _model():
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 192)

    def attend(x):
        q, k, v = proj(x).view(2, 48, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)

    return attend, torch.randn(2, 48, 64)


def _untraceable_frame(k, k_op, lse, p_mode):
    """The hybrid's old failure: a Python float from a tensor under AOTAutograd's fake tensors."""
    return k, lse - math.log(lse.exp().sum().item() / lse.numel())


def test_failed_site_is_left_to_sdpa_with_its_reason(monkeypatch, caplog):
    attend, x = _model()
    want = attend(x)
    want.sum().backward()
    monkeypatch.setattr(attention, "bf16_backward_frame", _untraceable_frame)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(attend, backend=fp4_inductor.backend(overrides={"*": HYBRID}), fullgraph=True)
    # caches off: a graph cached by an earlier run is never traced, so it could not fail
    with caplog.at_level(logging.WARNING, logger="fp4_inductor"), torch._inductor.config.patch(force_disable_caches=True):
        got = compiled(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert rel_l2(got, want) < 1e-5  # SDPA itself, compiled
    assert any("left to SDPA" in r.getMessage() and "compiling them with fp4attn's ops failed" in r.getMessage()
               for r in caplog.records)
    with fp4_inductor.configure(overrides={"*": HYBRID}):
        report = fp4_inductor.explain(attend, x)
    assert report.error is None and report.graphs == 1
    (site,) = report.sites
    assert site.path == "bf16" and site.reason.startswith("left to SDPA: compiling this graph"), site


def test_a_compile_that_fails_without_our_ops_still_raises(monkeypatch):
    """Our sites put back, the graph is compiled once more; an error of its own is the user's."""
    attend, x = _model()

    def broken(*args, **kwargs):
        raise RuntimeError("not ours")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", broken)
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=fp4_inductor.backend(overrides={"*": "fp8"}), fullgraph=True)
    try:
        compiled(x)
    except Exception as err:  # Dynamo wraps the backend's error
        assert "not ours" in str(err)
    else:
        raise AssertionError("the compile error was swallowed")
