"""Compiled graphs hit Inductor's FX graph cache across processes and still call our op;
the policy is part of what is cached.  The backend is found with no import of ours."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, torch
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 768)
    x = torch.randn(2, 96, 256)

    def attention(x):
        q, k, v = layer(x).view(2, 96, 3, 4, 64).permute(2, 0, 3, 1, 4).unbind(0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    if os.environ.get("OTHER_SOURCES"):  # stands for another version of this package
        import fp4_inductor.compiler
        fp4_inductor.compiler._package_hash = lambda: b"other sources"
    compiled = torch.compile(attention, backend="fp4attn")  # no import of fp4_inductor before this
    with torch.no_grad():
        out = compiled(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled(x)
    calls = sum(e.name == "fp4attn::fwd" for e in prof.events())
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                      "calls": calls, "out": out.double().sum().item()}))
    """
)


def _run(tmp_path, policy, other_sources=False):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), FP4ATTN_POLICY=policy,
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", OTHER_SOURCES="1" if other_sources else "")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fx_graph_cache_hit_still_calls_op_and_policy_changes_result(tmp_path):
    first = _run(tmp_path, "always")
    second = _run(tmp_path, "always")
    never = _run(tmp_path, "never")
    assert first["miss"] >= 1 and first["calls"] == 1
    assert second["hit"] >= 1 and second["miss"] == 0 and second["calls"] == 1
    assert second["out"] == first["out"]
    assert never["calls"] == 0 and never["miss"] >= 1  # a different graph, not a stale hit
    assert never["out"] != first["out"]



def test_fx_graph_cache_is_keyed_on_our_sources(tmp_path):
    """A graph cached under another version of the package (its ops' fakes may give other
    shapes) is not served: the cache misses, and the op still runs."""
    first = _run(tmp_path, "always")
    other = _run(tmp_path, "always", other_sources=True)
    assert first["miss"] >= 1 and other["miss"] >= 1 and other["hit"] == 0 and other["calls"] == 1
