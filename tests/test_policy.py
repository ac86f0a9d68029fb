"""Decision logic: cost model over a measured table, overrides, tuned decisions, and the
tuning cache's handling of bad files.  Synthetic tables; no GPU needed."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx

import fp4_inductor
from fp4_inductor import policy, tuning
from fp4_inductor.attention import lowp_attention
from fp4_inductor.config import Options
from fp4_inductor.patterns import find_sites
from fp4_inductor.patterns.common import Site
from helpers import cosine, op_calls

TABLE = {
    "gpu": "Test GPU",
    "source": "synthetic",
    "launch_us": 20.0,
    "tflops": {
        "bf16": {"d128/full/fwd": {"512": 400, "4096": 600, "16384": 610}},
        "fp8": {"d128/full/fwd": {"512": 300, "4096": 800, "16384": 900}},
    },
}


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A CUDA-like world on the CPU: kernels 'exist', the GPU is 'Test GPU' with TABLE."""
    monkeypatch.setattr(policy, "kernels_run_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(policy, "table_for", lambda gpu: policy.CostTable.from_json(json.dumps(TABLE)))
    monkeypatch.setenv("FP4ATTN_CACHE_DIR", str(tmp_path))


def _site(b=2, h=16, hkv=16, n=4096, d=128, causal=False, training=False, name="layers.3.attn"):
    graph = fx.Graph()
    nodes = []
    for label, heads in (("q", h), ("k", hkv), ("v", hkv)):
        node = graph.placeholder(label)
        node.meta["example_value"] = torch.empty(b, heads, n, d, requires_grad=training)
        nodes.append(node)
    return Site("sdpa", nodes[0], *nodes, causal=causal, name=name)


def test_rate_interpolates_in_log_length_and_clamps():
    table = policy.CostTable.from_json(json.dumps(TABLE))
    shape = lambda n: policy.SiteShape(1, 1, 1, n, n, 128, False, False)
    assert table.rate("fp8", shape(512)) == 300
    assert table.rate("fp8", shape(128)) == 300  # clamped below the grid
    assert table.rate("fp8", shape(65536)) == 900  # and above
    assert table.rate("fp8", shape(2048)) == pytest.approx(300 + 500 * 2 / 3)
    assert table.rate("fp8", policy.SiteShape(1, 1, 1, 512, 512, 64, False, False)) is None


def test_cost_model_picks_low_precision_only_where_faster(fake_gpu):
    big = policy.decide(_site(n=4096), Options())
    flops = 4.0 * 2 * 16 * 4096 * 4096 * 128
    expected = (flops / 600e12) / (flops / 800e12 + 20e-6)
    assert big.path == "fp8" and big.predicted_speedup == pytest.approx(expected)
    assert "cost model" in big.reason
    slow_rate = policy.decide(_site(n=512), Options())  # table: fp8 slower at 512
    assert slow_rate.path == "bf16" and slow_rate.predicted_speedup < 1
    tiny = policy.decide(_site(b=1, h=1, hkv=1, n=4096), Options())  # launch cost dominates
    assert tiny.path == "bf16" and "would be" in tiny.reason


def test_missing_table_or_rate_keeps_bf16(fake_gpu, monkeypatch):
    assert "no rate" in policy.decide(_site(d=64), Options()).reason
    # fp4 has no rate in TABLE: fp8's rate, where fp8 wins, must not stand in for it.
    fp4 = policy.decide(_site(n=4096), Options(fmt="fp4"))
    assert fp4.path == "bf16" and "no rate" in fp4.reason
    monkeypatch.setattr(policy, "table_for", lambda gpu: None)
    decision = policy.decide(_site(), Options())
    assert decision.path == "bf16" and "no measured cost table for Test GPU" in decision.reason


# What CUDA reports for an H200 (SM clock in kHz, memory clock in kHz, bus in bits).
H200_PROPS = dict(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, clock_rate=1_980_000,
                  memory_clock_rate=3_201_000, memory_bus_width=6144)


H100_PROPS = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, clock_rate=1_980_000,
                  memory_clock_rate=2_619_000, memory_bus_width=5120)


@pytest.mark.parametrize("props", [H200_PROPS, H100_PROPS], ids=["h200", "h100"])
def test_analytic_model_on_a_shipped_gpu_predicts_its_table_within_the_fit(monkeypatch, props):
    """Modelled from a shipped GPU's properties alone, the analytic model's speedups are its
    table's within the margin the model asks for there (the fit's error for the row family
    and length), training and masked rows included; a decision needs the path's own margin
    or that one, whichever is wider."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(**props))
    model = policy.AnalyticModel.of(torch.device("cuda", 0))
    assert model.sms == 132
    measured = policy.table_for(props["name"])
    shapes = [policy.SiteShape(max(16384 // n, 1), 2048 // d, 2048 // d, n, n, d, causal, training)
              for training in (False, True) for d in (64, 128) for causal in (False, True)
              for n in (512, 1024, 2048, 3000, 4096, 8192, 16384, 32768)]
    shapes += [policy.SiteShape(2, 16, 16, 8192, 8192, 128, True, training, mask="causal+padding")
               for training in (False, True)]
    path = policy.PricedPath("fp8")
    for shape in shapes:
        error = model.min_speedup(shape, "fp8") - 1
        assert 0 <= error < 0.5
        want = measured.speedup(shape, "fp8")
        assert model.speedup(shape, "fp8") == pytest.approx(want, rel=1.05 * error + 2e-3), shape
        assert policy._threshold(path, model, shape) == max(policy.MIN_SPEEDUP, 1 + error)
        if shape.nk >= 8192 and shape.mask == "none":  # where the two shipped tables agree
            assert error <= 0.05, shape


def test_unknown_gpu_falls_back_to_the_analytic_model_and_says_so(fake_gpu, monkeypatch):
    monkeypatch.setattr(policy, "table_for", lambda gpu: None)
    props = SimpleNamespace(**{**H200_PROPS, "name": "Test GPU"})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    long = policy.decide(_site(b=1, h=16, hkv=16, n=32768), Options())
    assert long.path == "fp8" and long.reason.startswith("analytic model (no measured table for Test GPU;")
    assert "calibrate() measures this GPU" in long.reason
    short = policy.decide(_site(n=1024), Options())
    assert short.path == "bf16" and "analytic model" in short.reason
    train = policy.decide(_site(training=True), Options())  # priced now: the fit has training rows
    assert train.path == "bf16" and train.reason.startswith("analytic model") and train.predicted_speedup


def test_overrides_first_match_wins_over_policy(fake_gpu):
    opts = Options(policy="always", overrides=(("layers.0.*", "bf16"), ("layers.*", "fp4")))
    assert policy.decide(_site(name="layers.0.attn"), opts).path == "bf16"
    assert policy.decide(_site(name="layers.7.attn"), opts).path == "fp4"
    assert policy.decide(_site(name="head.attn"), opts).path == "fp8"
    # An override never forces an unsupported site.
    assert policy.decide(_site(d=300, name="layers.7.attn"), opts).path == "bf16"


def test_configure_overrides_validated():
    with pytest.raises(ValueError):
        fp4_inductor.configure(overrides={"layers.*": "int4"})
    with fp4_inductor.configure(overrides={"layers.0.*": "bf16"}):
        assert fp4_inductor.config.current().overrides == (("layers.0.*", "bf16"),)
    assert fp4_inductor.config.current().overrides == ()


def test_environment_variables_are_named_when_wrong_and_empty_means_unset(monkeypatch):
    monkeypatch.setenv("FP4ATTN_POLICY", "sometimes")
    with pytest.raises(ValueError, match="FP4ATTN_POLICY"):
        fp4_inductor.config.current()
    monkeypatch.setenv("FP4ATTN_POLICY", " ")
    monkeypatch.setenv("FP4ATTN_FORMAT", "FP4")
    assert (fp4_inductor.config.current().policy, fp4_inductor.config.current().fmt) == ("auto", "fp4")


def test_p_mode_is_one_of_fp8_s_modes():
    with pytest.raises(ValueError, match="p_mode"):
        fp4_inductor.configure(p_mode="fp4")


def test_a_configure_object_applies_each_time_it_is_entered():
    block = fp4_inductor.configure(policy="never")
    with block:
        assert fp4_inductor.config.current().policy == "never"
    assert fp4_inductor.config.current().policy == "auto"
    with block:
        assert fp4_inductor.config.current().policy == "never"
    assert fp4_inductor.config.current().policy == "auto"


def test_tuned_decision_takes_precedence(fake_gpu):
    site = _site(n=4096)
    key = policy.site_key(site, "fp8", None)
    tuned = {key: {"path": "bf16", "speedup": 0.97, "cosine": 0.999, "t_low_ms": 1.0, "t_bf16_ms": 0.97}}
    decision = policy.decide(site, Options(), tuned)
    assert decision.path == "bf16" and decision.reason.startswith("tuned on this GPU")


def test_symbolic_shapes_decide_from_size_hints(fake_gpu):
    decisions = []

    def capture(gm, example_inputs):
        for site in find_sites(gm.graph):
            decisions.append((site.shape(), policy.decide(site, Options())))
        return gm.forward

    fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    q, k, v = (torch.randn(1, 2, 4096, 128) for _ in range(3))
    torch.compile(fn, backend=capture, dynamic=True)(q, k, v)
    (shape, decision), = decisions
    assert shape == (1, 2, 2, 4096, 4096, 128)
    assert decision.predicted_speedup is not None


@pytest.fixture
def crossover_2k(fake_gpu, monkeypatch):
    rates = {path: {**by_key, "d128/full/train": by_key["d128/full/fwd"]} for path, by_key in TABLE["tflops"].items()}
    table = policy.CostTable.from_json(json.dumps({**TABLE, "launch_us": 0.0, "tflops": rates}))
    monkeypatch.setattr(policy, "table_for", lambda gpu: table)
    threshold = policy.crossover_length(policy.SiteShape(1, 2, 2, 4096, 4096, 128, False, False), "fp8", table)
    assert threshold == 2048  # rates cross (with the margin) between 1k and 2k keys
    return threshold


def _graphs_compiled(fn, sizes, requires_grad=False):
    """Run ``fn`` compiled with dynamic shapes at each key length; return whether each
    call ran the low-precision forward, and how many graphs were compiled."""
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return fp4_inductor.backend()(gm, example_inputs)

    compiled = torch.compile(fn, backend=counting, dynamic=True)
    ran_op = []
    for n in sizes:
        q, k, v = (torch.randn(1, 2, n, 128, requires_grad=requires_grad) for _ in range(3))
        _, calls = op_calls(compiled, q, k, v)
        ran_op.append(calls["fwd"] == 1)
    return ran_op, len(graphs)


def _sdpa_fn(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_dynamic_length_branches_at_run_time(crossover_2k):
    """Inference under dynamic shapes: one graph whose op picks the path per call from the
    actual key length, no guard and no recompile at the crossover."""
    sizes = (4096, 512, crossover_2k, crossover_2k - 16, 8192)
    ran_op, graphs = _graphs_compiled(_sdpa_fn, sizes)
    assert ran_op == [n >= crossover_2k for n in sizes]
    assert graphs == 1


def test_multihead_attention_branches_at_run_time(crossover_2k):
    """nn.MultiheadAttention under no_grad (its weights require grad: still inference)
    with a dynamic length: one graph, the path chosen per call."""
    torch._dynamo.reset()
    mha = torch.nn.MultiheadAttention(256, 2, batch_first=True).eval()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return fp4_inductor.backend()(gm, example_inputs)

    compiled = torch.compile(lambda x: mha(x, x, x, need_weights=False)[0], backend=counting, dynamic=True)
    sizes = (4096, 512, crossover_2k, crossover_2k - 16)
    with torch.no_grad():
        ran_op = [op_calls(compiled, torch.randn(1, n, 256))[1]["fwd"] == 1 for n in sizes]
    assert ran_op == [n >= crossover_2k for n in sizes]
    assert sum(any(node.op == "call_function" for node in gm.graph.nodes) for gm in graphs) == 1


def test_crossover_keeps_a_fixed_query_length():
    """Decode (a fixed handful of queries, a growing cache) quantizes the whole cache for
    those queries: priced at its ``rate_length`` (under 2 Nq), it never crosses over, and
    a site growing in proportion crosses only once its queries alone are many.  Prefill
    crosses where the square table does."""
    table = policy.CostTable.from_json(json.dumps(TABLE))
    decode = policy.SiteShape(8, 32, 32, 16, 4096, 128, False, False)
    assert policy.crossover_length(decode, "fp8", table, vary="keys") is None
    assert policy.crossover_length(decode, "fp8", table, vary="both") == 262144  # 1024 queries there
    prefill = dataclasses.replace(decode, nq=4096)
    assert policy.crossover_length(prefill, "fp8", table, vary="both") == 2048


def test_tuned_decision_does_not_fix_a_dynamic_length(crossover_2k):
    """tune() measured one shape; under dynamic shapes the length decides per call."""
    decisions = []

    def capture(gm, example_inputs):
        for site in find_sites(gm.graph):
            tuned = {policy.site_key(site, "fp8", None): _entry(path="bf16", speedup=0.9)}
            decisions.append(policy.decide(site, Options(), tuned))
        return gm.forward

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 4096, 128) for _ in range(3))
    torch.compile(_sdpa_fn, backend=capture, dynamic=True)(q, k, v)
    (decision,) = decisions
    assert decision.min_keys == crossover_2k and not decision.reason.startswith("tuned")


def test_dynamic_query_length_with_fixed_keys_guards_at_its_crossover(fake_gpu, monkeypatch):
    """A fixed cache with a varying number of queries (chunked prefill, speculative
    decoding): the query length decides, through a guard, as few queries pay the launch
    costs over little work."""
    slow = {"launch_us": 1000.0, "tflops": {"bf16": {"d128/full/fwd": {"256": 0.01}},
                                           "fp8": {"d128/full/fwd": {"256": 0.02}}}}
    table = policy.CostTable.from_json(json.dumps({**TABLE, **slow}))
    monkeypatch.setattr(policy, "table_for", lambda gpu: table)
    threshold = policy.crossover_length(policy.SiteShape(1, 2, 2, 256, 256, 128, False, False), "fp8", table,
                                        vary="queries")
    assert 16 < threshold < 256
    torch._dynamo.reset()
    graphs, reasons = [], []

    def counting(gm, example_inputs):
        graphs.append(gm)
        reasons.extend(policy.decide(site, Options()).reason for site in find_sites(gm.graph))
        return fp4_inductor.backend()(gm, example_inputs)

    compiled = torch.compile(_sdpa_fn, backend=counting)
    k, v = torch.randn(1, 2, 256, 128), torch.randn(1, 2, 256, 128)
    sizes = (threshold * 2, 24, threshold, threshold - 8, 200)
    ran_op = []
    for n in sizes:
        q = torch.randn(1, 2, n, 128)
        torch._dynamo.mark_dynamic(q, 2)
        ran_op.append(op_calls(compiled, q, k, v)[1]["fwd"] == 1)
    assert ran_op == [n >= threshold for n in sizes]
    assert len(graphs) == 2 and all(f"fp8 from {threshold} queries" in reason for reason in reasons)


def test_run_time_branch_is_inference_only():
    q, k, v = (torch.randn(1, 2, 64, 64, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match="inference"):
        lowp_attention(q, k, v, min_keys=32)
    with torch.no_grad():
        assert lowp_attention(q, k, v, min_keys=32).shape == q.shape


def test_dynamic_length_in_training_guards_at_the_crossover(crossover_2k):
    """The run-time branch has no autograd: training recompiles once, across the crossover."""
    sizes = (4096, 8192, 512, 256)
    ran_op, graphs = _graphs_compiled(_sdpa_fn, sizes, requires_grad=True)
    assert ran_op == [True, True, False, False]
    assert graphs == 2


def _entry(**changes):
    entry = {"path": "fp8", "speedup": 1.3, "cosine": 0.998, "t_low_ms": 1.0, "t_bf16_ms": 1.3}
    entry.update(changes)
    return entry


def test_cache_roundtrip_is_atomic_and_merges(fake_gpu, tmp_path):
    tuning.save_decisions("Test GPU", {"a": _entry()})
    tuning.save_decisions("Test GPU", {"b": _entry(path="bf16")})
    assert tuning.load_decisions("Test GPU") == {"a": _entry(), "b": _entry(path="bf16")}
    assert [p.name for p in tmp_path.iterdir()] == ["decisions-test_gpu.json"]  # no temporaries left


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda doc: json.dumps(doc)[: len(json.dumps(doc)) // 2],  # truncated
        lambda doc: json.dumps({**doc, "schema": 99}),  # wrong schema
        lambda doc: json.dumps({**doc, "entries": {"a": _entry(speedup="fast")}}),  # wrong type
        lambda doc: json.dumps({**doc, "entries": {"a": _entry(path="int4")}}),  # unknown path
        lambda doc: json.dumps({**doc, "entries": {"a": {**_entry(), "pickle": "x"}}}),  # extra field
        lambda doc: json.dumps({**doc, "environment": {**doc["environment"], "gpu": "Other GPU"}}),  # foreign
        lambda doc: json.dumps([doc]),  # not an object
        lambda doc: json.dumps(doc).replace('"speedup": 1.3', '"speedup": ' + "1" + "0" * 400),  # beyond float
        lambda doc: json.dumps(doc).replace('"speedup": 1.3', '"speedup": ' + "7" * 5000),  # int-string limit
        lambda doc: json.dumps(doc).replace('"speedup": 1.3', '"speedup": 1e400'),  # parses as inf
        lambda doc: "[" * 100_000,  # recursion
        lambda doc: b"\xff\xfe" + json.dumps(doc).encode("utf-16-le"),  # another encoding
        lambda doc: json.dumps({**doc, "pad": "x" * (tuning.MAX_CACHE_BYTES + 1)}),  # too large
    ],
)
def test_bad_cache_files_are_ignored_with_a_warning(fake_gpu, corrupt):
    tuning.save_decisions("Test GPU", {"a": _entry()})
    path = tuning.cache_file("Test GPU")
    content = corrupt(json.loads(path.read_text()))
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.warns(RuntimeWarning, match="ignoring"):
        assert tuning.load_decisions("Test GPU") == {}


def test_fuzzed_cache_files_never_raise(fake_gpu, fresh_seed):
    """Random bytes, and a valid file with random bytes flipped: ignored or read, never raised."""
    import random
    import warnings

    rng = random.Random(fresh_seed)
    tuning.save_decisions("Test GPU", {"a": _entry()})
    path = tuning.cache_file("Test GPU")
    good = path.read_bytes()
    for _ in range(200):
        if rng.random() < 0.3:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        else:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert isinstance(tuning.load_decisions("Test GPU"), dict)


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_cache_that_is_not_a_regular_file_is_ignored(fake_gpu, tmp_path, kind):
    tuning.save_decisions("Test GPU", {"a": _entry()})
    path = tuning.cache_file("Test GPU")
    target = tmp_path / "elsewhere.json"
    path.rename(target)
    if kind == "symlink":
        path.symlink_to(target)  # a valid file behind it: still not ours to follow
    else:
        path.mkdir()
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert tuning.load_decisions("Test GPU") == {}


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FP4ATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_file("NVIDIA H200") == tmp_path / "fp4_inductor" / "decisions-nvidia_h200.json"


def test_tune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only error")
    with pytest.raises(RuntimeError, match="CUDA"):
        fp4_inductor.tune(lambda x: x, torch.randn(2))


def test_tune_records_each_site_on_real_activations(fake_gpu, monkeypatch):
    """tune()'s plumbing on the CPU: the probe runs both paths on the site's activations
    (timings stubbed: BF16 1 ms, low precision 0.5 ms) and the decision reaches the cache."""
    from attention_variants import SdpaCausal

    timings = iter([1.0, 0.5])
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(tuning, "_median_ms", lambda fn, rep_ms: (fn(), next(timings))[1])
    module = SdpaCausal().eval()
    x = torch.randn(2, 80, 256)
    with torch.no_grad():
        (result,) = fp4_inductor.tune(module, x)
        # The accuracy recorded is the site's own: our path against SDPA on its activations.
        q, k, v = module.heads(x)
        want = cosine(lowp_attention(q, k, v, is_causal=True),
                      torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert result.key == "fp8/direct/float32/b2/h4/kv4/q80/k80/d64/causal/fwd"
    assert result.entry["path"] == "fp8" and result.entry["speedup"] == 2.0
    assert 0.99 < result.entry["cosine"] < 1.0  # measured, not assumed
    # (Q, K, V from the compiled projections: a float rounding may flip an INT8 code)
    assert abs(result.entry["cosine"] - want) <= 1e-4, (result.entry["cosine"], want)
    assert tuning.load_decisions("Test GPU") == {result.key: result.entry}


@pytest.mark.parametrize("train", [False, True], ids=["fast-path", "mha"])
def test_tune_probes_sites_inside_multihead_attention(fake_gpu, monkeypatch, train):
    """The attention inside ``nn.MultiheadAttention``'s call (in training) and inside
    PyTorch's fused encoder layer (in eval under no_grad) is probed as any site's: the
    run-time function hands its attention to the probe."""
    timings = iter([1.0, 0.5, 0.6])
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(tuning, "_median_ms", lambda fn, rep_ms: (fn(), next(timings))[1])
    if train:
        module = torch.nn.MultiheadAttention(128, 2, batch_first=True)
        attend = lambda x: module(x, x, x, need_weights=False)[0]  # noqa: E731
    else:  # in eval under no_grad the encoder layer is one fused call
        attend = torch.nn.TransformerEncoderLayer(128, 2, 256, batch_first=True, dropout=0.0).eval()
    x = torch.randn(2, 96, 128)
    with torch.set_grad_enabled(train):
        (site,) = fp4_inductor.explain(attend, x, policy="always").sites
        (result,) = fp4_inductor.tune(attend, x)
    assert site.kind == ("mha" if train else "fast-path")
    assert result.key == f"fp8/direct/float32/b2/h2/kv2/q96/k96/d64/none/{'train' if train else 'fwd'}"
    assert result.entry["t_bf16_ms"] == 1.0 and result.entry["t_low_ms"] == 0.5
    assert 0.99 < result.entry["cosine"] < 1.0  # measured on the site's activations


def test_cache_key_names_what_timing_and_accuracy_depend_on():
    """A tuned decision must not serve a site of another dtype, with a mask, or in another
    P mode: each changes the times or the numerics."""
    plain = _site()
    bf16 = _site()
    bf16.q.meta["example_value"] = bf16.q.meta["example_value"].to(torch.bfloat16)
    masked = dataclasses.replace(_site(), attn_mask=plain.q)
    keys = {policy.site_key(plain, "fp8", None), policy.site_key(bf16, "fp8", None),
            policy.site_key(masked, "fp8", None), policy.site_key(plain, "fp8", "exp"),
            policy.site_key(plain, "fp4", None)}
    assert len(keys) == 5
    # p_mode "direct" is fp8's default: a decision tuned without it serves a compile with it.
    assert policy.site_key(plain, "fp8", "direct") == policy.site_key(plain, "fp8", None)


def test_tune_probes_fp4_in_the_p_mode_compiles_give_it(fake_gpu, monkeypatch):
    """p_mode is fp8's option: tune(fmt="fp4") measures fp4 as a compile would run it."""
    from attention_variants import SdpaCausal

    probed = []
    probe = tuning._probe
    monkeypatch.setattr(tuning, "_probe", lambda *a, **kw: (probed.append(kw["p_mode"]), probe(*a, **kw))[1])
    timings = iter([1.0, 0.5])
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(tuning, "_median_ms", lambda fn, rep_ms: (fn(), next(timings))[1])
    with torch.no_grad(), fp4_inductor.configure(p_mode="exp"):
        (result,) = fp4_inductor.tune(SdpaCausal().eval(), torch.randn(2, 80, 256), fmt="fp4")
    assert probed == [None] and result.key.startswith("fp4/fp4/")
    assert Options(p_mode="exp").p_mode_for("fp4") is None and Options(p_mode="exp").p_mode_for("fp8") == "exp"


@pytest.mark.parametrize("timings, want", [
    ((1.0, 0.95, 0.9), "fp8+bf16bwd"),  # bf16, fp8, hybrid (ms): the hybrid path is the fastest
    ((1.0, 0.88, 0.9), "fp8+bf16bwd"),  # within timing spread of the FP8 backward: BF16's gradients
    ((1.0, 0.5, 0.9), "fp8"),
    ((1.0, 0.99, 0.99), "bf16"),
])
def test_tune_times_the_hybrid_path_at_training_sites(fake_gpu, monkeypatch, timings, want):
    """A training site's probe also times the hybrid path (FP8 forward, BF16 backward), keeps
    it by the cost model's rule, and the policy takes the tuned path from the cache."""
    from attention_variants import SdpaCausal

    order = iter(timings)
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(tuning, "_median_ms", lambda fn, rep_ms: (fn(), next(order))[1])
    module, x = SdpaCausal(), torch.randn(2, 80, 256, requires_grad=True)
    (result,) = fp4_inductor.tune(module, x)
    assert result.key.endswith("/train") and result.entry["t_hybrid_ms"] == timings[2], result
    assert result.entry["path"] == want, result.entry
    site = _site(b=2, h=4, hkv=4, n=80, d=64, causal=True, training=True)
    assert policy.site_key(site, "fp8", None) == result.key
    decision = policy.decide(site, Options(), tuning.load_decisions("Test GPU"))
    assert decision.path == want and decision.reason.startswith("tuned on this GPU"), decision


def test_tune_keeps_bf16_below_the_accuracy_guard(fake_gpu, monkeypatch):
    from attention_variants import SdpaCausal

    timings = iter([1.0, 0.5])
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(tuning, "_median_ms", lambda fn, rep_ms: (fn(), next(timings))[1])
    with torch.no_grad():
        (result,) = fp4_inductor.tune(SdpaCausal().eval(), torch.randn(2, 80, 256), min_cosine=0.99999)
    assert result.entry["path"] == "bf16" and result.entry["speedup"] == 2.0


@pytest.mark.gpu
def test_tune_writes_and_reuses_decisions(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4ATTN_CACHE_DIR", str(tmp_path))
    from attention_variants import SdpaCausal

    module = SdpaCausal().cuda().to(torch.bfloat16).eval()
    x = torch.randn(2, 80, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        results = fp4_inductor.tune(module, x, rep_ms=20)
    assert len(results) == 1 and results[0].entry["path"] in ("fp8", "bf16")
    assert tuning.load_decisions(torch.cuda.get_device_name()).keys() == {results[0].key}
    torch._dynamo.reset()
    with torch.no_grad():  # the decisions were tuned for inference
        report = fp4_inductor.explain(module, x, policy="auto")
    assert report.sites[0].reason.startswith("tuned on this GPU")
    assert report.sites[0].path == results[0].entry["path"]


@pytest.mark.parametrize("scale, kept", [(None, True), (-1.0, True), (2.0, True), (4.0, False), (-1e4, False),
                                         (((1e4, False), (0.5, True)), False), (((8.0, True),), True)])
def test_near_one_hot_scales_keep_bf16(scale, kept):
    """Softmax scales beyond 16/sqrt(D) make attention near one-hot, where 8-bit Q/K swap
    near-tied keys (SDPA's test with scale -1e4: 0.14-0.21 rel-L2): such sites keep BF16
    under every policy, and explain says why."""
    site = dataclasses.replace(_site(d=64), scale=scale)
    reason = policy.unsupported_reason(site)
    assert (reason is None) == kept, reason
    if not kept:
        assert "near one-hot" in reason
        assert policy.decide(site, Options(policy="always")).path == "bf16"


def test_near_one_hot_sdpa_site_falls_back_when_compiled():
    q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
    fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=-1e4)  # noqa: E731
    report = fp4_inductor.explain(fn, q, k, v)
    assert [s.path for s in report.sites] == ["bf16"] and "near one-hot" in report.sites[0].reason
