"""Which kernel ``kernels.forward_kernel`` and ``kernels.backward_kernel`` run (CPU: the
kernel modules are stand-ins)."""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch

from fp4_inductor import kernels


@pytest.fixture
def launched(monkeypatch):
    """Stand-in Gluon and Triton modules; returns the list of kernels called (a Gluon
    launch raises when the list holds "break gluon")."""
    calls = []

    def module(family, name):
        def attention_forward(*args, **structure):
            if family == "gluon" and "break gluon" in calls:
                raise RuntimeError("compile error")
            calls.append(family)

        def supports(q, k, v_t, q_scale, bias, p_mode, lse, row_ref):
            return bias is None and k.shape[2] % 16 == 0

        return types.SimpleNamespace(attention_forward=attention_forward, supports=supports)

    monkeypatch.setattr(kernels, "_module", module)
    monkeypatch.setattr(kernels, "_gluon_failed", set())
    return calls


def _launch(p_mode, causal, nq, nk, bias=None, d=128, diagonal=0, window=0, b=2, h=8, documents=False):
    q, k, v_t = torch.empty(b, h, nq, d), torch.empty(b, h, nk, d), torch.empty(b, h, d, nk)
    rows = torch.empty(b, h, nq)
    ids = (torch.zeros(b, nq, dtype=torch.long), torch.zeros(b, nk, dtype=torch.long)) if documents else (None, None)
    kernels._forward(q, k, v_t, rows, None, None, bias, causal, p_mode, q, rows, rows, diagonal, window, *ids)


@pytest.mark.parametrize("p_mode,causal,nq,nk,bias,expected,extra", [
    ("direct", True, 8192, 8192, None, "gluon", {"diagonal": 4}),  # a causal offset
    ("direct", True, 8192, 8192, None, "gluon", {"window": 4096}),  # a window
    ("direct", True, 8192, 8192, None, "triton", {"window": 1024}),  # a window of few tiles: unmeasured
    ("direct", True, 8192, 8192, None, "triton", {"window": 4096, "d": 64}),  # measured slower at D = 64
    ("direct", False, 8192, 8192, None, "triton", {"d": 96}),  # head dims the Gluon kernel lacks
    ("direct", False, 2048, 2048, None, "gluon", {}),
    ("direct", False, 2032, 2032, None, "triton", {}),  # below GLUON_MIN_KEYS at D = 128
    ("direct", False, 2048, 2048, None, "triton", {"d": 64}),  # D = 64 needs more keys
    ("direct", False, 4096, 4096, None, "gluon", {"d": 64}),
    ("direct", False, 4104, 4104, None, "triton", {}),  # keys not a multiple of 16
    ("direct", False, 1, 8192, None, "triton", {}),  # decode
    ("direct", False, 256, 8192, None, "gluon", {"b": 8, "h": 8}),  # few queries, 128 programs
    ("direct", False, 256, 8192, None, "triton", {}),  # too few query rows for the GPU
    ("direct", False, 256, 8192, None, "triton", {"b": 8, "h": 8, "d": 64}),  # D = 64 needs 1024 queries
    ("direct", True, 2048, 2048, None, "triton", {}),  # causal needs more keys
    ("direct", True, 4096, 4096, None, "gluon", {}),
    ("direct", True, 4096, 4096, None, "triton", {"d": 64}),
    ("direct", False, 4096, 4096, torch.zeros(1), "triton", {}),  # outside the Gluon kernel's scope
    ("direct", True, 4096, 4096, None, "triton", {"documents": True}),  # document ids: not yet measured on Gluon
    ("exp", False, 8192, 8192, None, "triton", {}),  # measured faster on Triton
    ("fp4", False, 8192, 8192, None, "triton", {}),
])
def test_forward_dispatch(launched, p_mode, causal, nq, nk, bias, expected, extra):
    _launch(p_mode, causal, nq, nk, bias, **extra)
    assert launched == [expected]


def test_gluon_failure_falls_back_to_triton_once(launched):
    launched.append("break gluon")
    with pytest.warns(RuntimeWarning, match="Gluon forward kernel failed"):
        _launch("direct", False, 4096, 4096)
    _launch("direct", False, 4096, 4096)  # remembered: no second attempt, no second warning
    assert launched == ["break gluon", "triton", "triton"]


@pytest.mark.parametrize("choose,launch,n_grads,what", [("_gluon_dq", "dq_backward", 1, "dQ"),
                                                        ("_gluon_dkdv", "dkdv_backward", 2, "dK/dV")])
def test_gluon_backward_failure_leaves_it_to_triton_once(choose, launch, n_grads, what, monkeypatch):
    """A failing Gluon backward kernel warns once and returns False (the Triton kernel then
    runs), and is not tried again; outside its scope it is not tried at all."""
    prep = pytest.importorskip("fp4_inductor.kernels.triton.attention_bwd_prep")
    calls = []

    def backward(*args):
        calls.append("gluon")
        raise RuntimeError("compile error")

    in_scope = {"value": False}
    gluon = types.SimpleNamespace(supports=lambda *args: in_scope["value"], **{launch: backward})
    monkeypatch.setattr(kernels, "_module", lambda family, name: gluon)
    monkeypatch.setattr(kernels, "_gluon_failed", set())
    operands = types.SimpleNamespace(**{f.name: None for f in dataclasses.fields(prep.BackwardOperands)})
    run = functools.partial(getattr(kernels, choose), operands, *(None,) * n_grads, bias=None, p_mode="direct")
    assert run() is False
    assert calls == []
    in_scope["value"] = True
    with pytest.warns(RuntimeWarning, match=f"Gluon {what} kernel failed"):
        assert run() is False
    assert run() is False  # remembered: no second warning
    assert calls == ["gluon"]


@pytest.mark.parametrize("shape,row_b,row_h", [((3, 1, 1, 40), 1, 0), ((1, 4, 1, 40), 0, 1), ((3, 4, 1, 40), 4, 1),
                                               ((1, 1, 1, 40), 1, 0)])
def test_key_rows_index_the_bias_of_each_batch_and_head(shape, row_b, row_h):
    """The Gluon forward's key-bias rows (``kernels/triton/key_bias.py``): row
    ``batch * row_b + head * row_h`` is the bias every query of (batch, head) adds."""
    from fp4_inductor.kernels.triton import key_bias

    b, h, nq, nk = 3, 4, 7, 40
    bias = torch.randn(shape).to(torch.bfloat16)
    rows, rb, rh = key_bias.key_rows(bias, b, h, nq, nk)
    assert (rb, rh) == (row_b, row_h) and rows.dtype == torch.float32 and rows.is_contiguous()
    full = bias.float().expand(b, h, nq, nk)
    for i in range(b):
        for j in range(h):
            assert torch.equal(rows[i * rb + j * rh], full[i, j, 0])
    assert key_bias.key_rows(torch.randn(b, 1, nq, nk), b, h, nq, nk) is None  # varies over queries
    assert key_bias.key_rows(torch.randn(b, 1, 1, nk), b, h, 1, nk) is not None
    assert not key_bias.key_row_bias(torch.randn(b, 2, 1, nk), b, h, nq, nk)  # does not broadcast


@pytest.mark.parametrize("key_bias", [False, True], ids=["off", "on"])
def test_gluon_backward_scope_and_key_bias(key_bias, monkeypatch):
    """The Gluon dQ and dK/dV kernels take no bias, and a key-row bias only with their
    ``KEY_BIAS`` on (shipped on); a bias that varies over queries never (the Triton kernels)."""
    DQ = pytest.importorskip("fp4_inductor.kernels.gluon.attention_bwd_dq")  # a Triton with Gluon
    DKDV = pytest.importorskip("fp4_inductor.kernels.gluon.attention_bwd_dkdv")

    assert DQ.KEY_BIAS and DKDV.KEY_BIAS  # what ships
    monkeypatch.setattr(DQ, "KEY_BIAS", key_bias)
    monkeypatch.setattr(DKDV, "KEY_BIAS", key_bias)
    b, h, hkv, n, d = 2, 4, 2, 256, 128
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    q, k = torch.empty(b, h, n, d, dtype=torch.int8), torch.empty(b, hkv, n, d, dtype=torch.int8)
    v, do = torch.empty(b, hkv, n, d, dtype=e4m3), torch.empty(b, h, n, d, dtype=e5m2)
    rows = [torch.empty(b, h, n) for _ in range(3)]  # q_scale, row_ref, delta
    q_scale, row_ref, delta = rows
    ke_t, qe_t, do_t = torch.empty(b, hkv, d, n, dtype=e4m3), torch.empty(b, h, d, n, dtype=e4m3), \
        torch.empty(b, h, d, n, dtype=e5m2)
    k_scale, ke_scale, qe_scale = torch.empty(b, hkv, n // 128), torch.empty(b, hkv, n // 128), \
        torch.empty(b, h, n // 128)
    do_scale, v_scale = torch.empty(b, h), torch.empty(b, hkv)
    dq, dk, dv = torch.empty(b, h, n, d), torch.empty(b, hkv, n, d), torch.empty(b, hkv, n, d)
    key_row = torch.zeros(b, 1, 1, n)
    dense = torch.zeros(b, h, n, n)

    def dq_takes(bias):
        return DQ.supports(do, delta, q, k, v, q_scale, ke_t, k_scale, ke_scale, row_ref, bias, "direct", dq)

    def dkdv_takes(bias):
        return DKDV.supports(do, do_t, do_scale, delta, q, qe_t, qe_scale, k, v, q_scale, k_scale, v_scale, row_ref,
                             True, dk, dv, bias, "direct")

    for takes in (dq_takes, dkdv_takes):
        assert takes(None)
        assert takes(key_row) is key_bias
        assert not takes(dense)


@pytest.mark.parametrize("gluon_takes", [True, False], ids=["gluon", "triton"])
def test_backward_kernels_share_one_key_rows(gluon_takes, monkeypatch, fresh_seed):
    """With a key-row bias the backward builds one ``KeyRows`` and hands it to the kernels
    of both directions: one copy of the rows and one tile-ranges launch a call, whichever
    kernels run (Gluon where they take the call, else Triton, which skip the same tiles)."""
    from fp4_inductor import formats as F
    from fp4_inductor.kernels.triton import attention_bwd, attention_bwd_prep, key_bias

    torch.manual_seed(fresh_seed)
    b, h, n, d = 2, 2, 256, 64
    ranges_launched, seen = [], []

    def tile_ranges(rows, block_n):
        ranges_launched.append(block_n)
        return torch.zeros(rows.shape[0], 4, dtype=torch.int32)

    class Recorded:  # a jitted kernel whose launches record the skip ranges they read
        def __init__(self, kernel):
            self.ranges = kernel.arg_names.index("RANGES")

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(args[self.ranges] if kwargs["SKIP_MASKED"] else None)

    def gluon_module(name):
        def launch(*args):
            seen.append(args[-1])
            key_bias.launch_rows(args[-1], F.KEY_TILE, args[0])
        return types.SimpleNamespace(supports=lambda *args: gluon_takes, dq_backward=launch, dkdv_backward=launch)

    triton_module = kernels._module
    monkeypatch.setattr(kernels, "_module", lambda family, name: gluon_module(name) if family == "gluon"
                        else triton_module(family, name))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Gluon kernels do not run interpreted
    monkeypatch.setattr(key_bias, "tile_ranges", tile_ranges)
    monkeypatch.setattr(attention_bwd_prep, "_transpose_all", lambda pairs: None)
    for name in ("_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        monkeypatch.setattr(attention_bwd, name, Recorded(getattr(attention_bwd, name)))

    keep = torch.arange(n) < torch.tensor([[n], [n // 2]])
    e4m3, e5m2 = F.E4M3, F.E5M2
    q8, k8 = (torch.randint(-127, 128, (b, h, n, d), dtype=torch.int8) for _ in range(2))
    v_t, qe, ke = (torch.randn(*shape).to(e4m3) for shape in ((b, h, d, n), (b, h, n, d), (b, h, n, d)))
    do8 = torch.randn(b, h, n, d).to(e5m2)
    rows = [torch.rand(b, h, n) for _ in range(3)]
    blocks = torch.rand(b, h, F.scale_blocks(n))
    grads = [torch.empty(b, h, n, d, dtype=torch.bfloat16) for _ in range(3)]
    kernels._backward(
        do8, torch.rand(b, h), rows[0], q8, k8, v_t, rows[1], blocks, torch.rand(b, h), qe, blocks, ke, blocks,
        F.mask_to_log2_bias(None, keep), rows[2], True, "direct", *grads)

    assert len(seen) == 2 and seen[0] is seen[1] and seen[0] is not None
    assert isinstance(seen[0], key_bias.KeyRows) if gluon_takes else isinstance(seen[0], torch.Tensor)
    assert ranges_launched == [F.KEY_TILE]


@pytest.mark.parametrize("documents", [False, True])
def test_backward_offers_the_gluon_kernels_no_document_ids(documents, monkeypatch):
    """In the Gluon backward's scope (D = 128, P mode direct, no offset) both directions go
    to the Gluon kernels, and neither with document ids (not yet measured there): then the
    Triton kernels take them, and the ids reach the preparation either way."""
    seen, ran = {}, []

    def prepare(*args):
        seen["documents"] = args[-2:]
        return types.SimpleNamespace(emulate=False)

    def record(name, took=True):
        return lambda *args: ran.append(name) or took

    monkeypatch.setattr(kernels, "_module", lambda family, name: types.SimpleNamespace(
        prepare=prepare, dkdv_backward=record("triton dK/dV"), dq_backward=record("triton dQ")))
    monkeypatch.setattr(kernels, "_gluon_dkdv", record("gluon dK/dV"))
    monkeypatch.setattr(kernels, "_gluon_dq", record("gluon dQ"))
    b, h, n, d = 2, 4, 256, 128
    t, rows = torch.empty(b, h, n, d), torch.empty(b, h, n)
    ids = torch.zeros(b, n, dtype=torch.long) if documents else None
    kernels._backward(t, rows, rows, t, t, torch.empty(b, h, d, n), rows, rows, rows, t, rows, t, rows, None, rows,
                      True, "direct", t, t, t, q_documents=ids, k_documents=ids)
    assert seen["documents"][0] is ids and seen["documents"][1] is ids
    assert ran == (["triton dK/dV", "triton dQ"] if documents else ["gluon dK/dV", "gluon dQ"])


@pytest.mark.parametrize("change,applies", [
    ({}, True),
    ({"d": 64}, True),
    ({"causal": False}, True),
    ({"d": 96}, False),  # head dims it lacks
    ({"bias": True}, False),
    ({"window": 256}, False),  # causal structures other than SDPA's
    ({"documents": True}, False),
    ({"p_mode": "exp"}, False),
    ({"switch": "0"}, False),
    ({"failed": True}, False),  # its launch failed once in this process
    ({"grad_dtype": torch.float32}, False),  # dQ's reduce-adds are bf16
    ({"b": 40000}, False),  # past the grid's second dimension (B * Hkv < 65536)
    ({"interpret": True}, False),  # the Triton interpreter: no Gluon kernel runs
])
def test_fused_backward_applies_from_what_a_graph_knows(change, applies, monkeypatch):
    """Where the backward graph hands the op the forward's INT8 codes instead of E4M3
    copies: the one-kernel backward switched on, P mode direct, D = 64 or 128, no bias, no
    document ids, SDPA's causal structure or none (on an sm_90 GPU, stood in for here)."""
    pytest.importorskip("triton.experimental.gluon")
    monkeypatch.setattr(kernels, "_applies", lambda q: True)
    monkeypatch.setattr(kernels, "_gluon_failed", {"attention_bwd_fused"} if change.get("failed") else set())
    monkeypatch.setenv("FP4ATTN_FUSED_BACKWARD", change.get("switch", "1"))
    monkeypatch.setenv("TRITON_INTERPRET", "1" if change.get("interpret") else "0")
    b, d = change.get("b", 2), change.get("d", 128)
    q, k, v_t = (torch.empty(size, dtype=torch.int8).expand(b, -1, -1, -1)  # no memory for the large batch
                 for size in ((1, 8, 512, d), (1, 4, 512, d), (1, 4, d, 512)))
    bias = torch.zeros(b, 1, 1, 512) if change.get("bias") else None
    documents = torch.zeros(b, 512, dtype=torch.long) if change.get("documents") else None
    assert kernels.fused_backward_applies(q, k, v_t, bias, change.get("causal", True), change.get("p_mode", "direct"),
                                          0, change.get("window", 0), documents,
                                          change.get("grad_dtype", torch.bfloat16)) is applies


def test_fused_backward_applies_under_dynamo(monkeypatch):
    """Dynamo, tracing an autograd.Function's backward with ``fullgraph`` (a model that
    calls the attention directly under ``torch.compile``), takes the answer as a constant
    rather than breaking the graph on the module import behind it."""
    pytest.importorskip("triton.experimental.gluon")
    monkeypatch.setattr(kernels, "_applies", lambda q: True)
    monkeypatch.setattr(kernels, "_gluon_failed", set())
    monkeypatch.setenv("FP4ATTN_FUSED_BACKWARD", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def scaled(q, k, v_t):
        return q.float() * (2.0 if kernels.fused_backward_applies(q, k, v_t, None, True, "direct") else 1.0)

    q, k, v_t = torch.ones(1, 2, 64, 128, dtype=torch.int8), torch.ones(1, 1, 64, 128), torch.ones(1, 1, 128, 64)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(scaled, backend="eager", fullgraph=True)(q, k, v_t), 2 * q.float())
