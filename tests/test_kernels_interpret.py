"""The Triton backward kernels on the CPU, under Triton's interpreter, against
``reference.attention_backward`` with the GPU tests' rules (``bwd_checks.py``).

``TRITON_INTERPRET=1`` runs the kernels' own code with numpy, and the launcher's emulation
path computes the 8-bit products in float32 from exact E4M3/E5M2 values, so tiling, masks,
scales, GQA indexing and the dS quantization are checked where no GPU is.  What only a GPU
shows (the tensor cores' accumulation, the float8 casts, the compiler) stays with
``test_kernels_bwd_gpu.py``.  The interpreter must be on before Triton is imported, so each
case runs in a fresh Python process.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import triton  # noqa: F401  (the test extra installs it; the cases import it again, interpreted)

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# (B, H, Hkv, Nq, Nk, D, bias), P mode, causal, extra (value head dim ``dv``, causal
# ``diagonal`` and ``window``): one key and one query, GQA with key padding, MQA with more
# keys than queries, a dense bias, each P mode, head dims that are not powers of two
# (the kernels' padded channels), D_qk != D_v, and the causal structures: bottom-right
# with a window, and more queries than keys (rows with no visible key).
CASES = [
    ((2, 4, 4, 1, 1, 64, None), "direct", True, {}),
    ((1, 4, 2, 203, 260, 128, "keypad"), "direct", False, {}),
    ((1, 4, 1, 130, 300, 64, None), "direct", True, {}),
    ((1, 2, 1, 257, 129, 64, "dense"), "direct", True, {}),
    ((1, 4, 1, 130, 140, 64, None), "exp", True, {}),
    ((1, 2, 2, 113, 300, 64, None), "fp4", False, {}),
    ((1, 2, 1, 140, 330, 80, None), "direct", True, {"diagonal": 190, "window": 150}),
    ((1, 2, 1, 300, 130, 40, "keypad"), "direct", True, {"diagonal": -170}),
    ((1, 1, 1, 65, 130, 192, None), "direct", False, {"dv": 128}),
    ((3, 2, 1, 200, 520, 64, "leftpad"), "direct", True, {"diagonal": 320}),  # whole masked tiles
    ((2, 4, 2, 150, 260, 64, "keyrow"), "exp", False, {}),  # a bias row per (batch, head), GQA
    # packed documents (``documents`` lengths per batch row): causal, and with key padding
    ((2, 2, 1, 330, 330, 64, None), "direct", True, {"documents": ((100, 60, 140, 30), (50, 200, 80))}),
    ((2, 2, 2, 300, 300, 64, "keypad"), "direct", False, {"documents": ((40, 150, 110), (300,))}),
]

SCRIPT = """
import sys, torch
from bwd_checks import check, operands, run
from helpers import documents_of
from fp4_inductor.kernels.triton import attention_bwd, key_bias
from triton.runtime.interpreter import InterpretedFunction
assert isinstance(attention_bwd._bwd_dkdv_kernel, InterpretedFunction), "not interpreted"
torch.manual_seed({seed})
extra = {extra!r}
structure = {{k: extra[k] for k in ("diagonal", "window") if k in extra}}
if "documents" in extra:
    structure["q_documents"] = structure["k_documents"] = documents_of(extra["documents"])
ops = operands(*{shape}[:6], {p_mode!r}, {causal}, {shape}[6], dv=extra.get("dv"), **structure)
# Padded rows with and without the skipping of their wholly masked tiles; the rest as shipped.
for skip in (False, True) if {shape}[6] in ("leftpad", "rightpad") else (True,):
    key_bias.TRITON_SKIPS_MASKED_TILES = skip
    grads, dumps = run(ops, {causal}, {p_mode!r}, device="cpu", **structure)
    check(ops, {causal}, {p_mode!r}, grads, dumps, **structure)
"""


def _interpreted(code: str):
    """Run ``code`` in a fresh Python process with Triton's interpreter on."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _case_id(case):
    (b, h, hkv, nq, nk, d, bias), p_mode, causal, extra = case
    more = "".join(f"-docs{'+'.join(str(len(r)) for r in v)}" if k == "documents" else f"-{k}{v}"
                   for k, v in extra.items())
    return f"b{b}h{h}kv{hkv}q{nq}k{nk}d{d}-{bias or 'nobias'}-{p_mode}-{'causal' if causal else 'full'}{more}"


@pytest.mark.parametrize("shape,p_mode,causal,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_triton_backward_matches_reference(shape, p_mode, causal, extra, fresh_seed):
    _interpreted(SCRIPT.format(seed=fresh_seed, shape=shape, p_mode=p_mode, causal=causal, extra=extra))


CODES_SCRIPT = """
import torch
from bwd_checks import check, operands, run
from fp4_inductor import formats as F
torch.manual_seed({seed})
ops = operands(1, 4, 2, 130, 200, 80, "direct", True, fused=True)  # E4M3 dO, the forward's codes
sm = 80 ** -0.5  # not a power of two: the derived copies' scales carry its rounding
codes = ops[:12] + (ops[7] * sm,) + ops[13:]  # K's scales times the softmax scale, as the graph passes them
qe, qes, ke, kes = F.backward_operands(ops[3], ops[6], ops[4], ops[7])
grads, dumps = run(codes, True, "direct", device="cpu")
check(ops[:9] + (qe, qes, ke, kes * sm) + ops[13:], True, "direct", grads, dumps)
"""


def test_triton_backward_takes_the_one_kernel_operands(fresh_seed):
    """The one-kernel backward's operands (E4M3 dO, the forward's INT8 codes and K's scales
    times the softmax scale in place of Qe/Ke), where its launch refuses them: the two
    kernels' preparation derives the copies, and their gradients with the E4M3 dO meet the
    reference's rules on those copies."""
    _interpreted(CODES_SCRIPT.format(seed=fresh_seed))


FORWARD_CASES = [
    ((2, 2, 2, 70, 300, 72, "keypad"), "direct", False, {}),
    ((3, 2, 1, 200, 700, 64, "leftpad"), "direct", True, {"diagonal": 500}),  # skipped tiles, rows of no key
    ((3, 2, 2, 150, 600, 64, "rightpad"), "exp", False, {}),
    ((1, 2, 1, 300, 130, 32, None), "direct", True, {"diagonal": -170}),
    ((1, 2, 1, 260, 400, 96, None), "direct", True, {"diagonal": 140, "window": 150}),
    ((1, 2, 1, 100, 300, 160, "dense"), "exp", True, {"window": 37}),
    ((1, 2, 1, 450, 450, 64, None), "exp", True, {"window": 256}),  # rows with no visible key in a tile
    ((1, 1, 1, 100, 300, 192, None), "fp4", False, {"dv": 128}),
    # packed documents: causal (tiles whole inside a document run unmasked), windowed with
    # key padding, and ids out of order along the sequence (no tile skipped)
    ((2, 2, 1, 330, 330, 64, None), "direct", True, {"documents": ((100, 60, 140, 30), (50, 200, 80))}),
    ((2, 2, 2, 400, 400, 64, "keypad"), "exp", True, {"window": 90, "documents": ((300, 100), (20, 380))}),
    ((1, 2, 1, 260, 260, 64, None), "direct", False, {"documents": ((100, 160),), "shuffled": True}),
]

FORWARD_SCRIPT = """
import torch
from helpers import documents_of, quantized_operands
from fp4_inductor import reference as R
from fp4_inductor.kernels.triton import attention_fwd
from triton.runtime.interpreter import InterpretedFunction
assert isinstance(attention_fwd._fwd_kernel, InterpretedFunction), "not interpreted"
torch.manual_seed({seed})
(b, h, hkv, nq, nk, d, bias_kind), p_mode, causal, extra = {case!r}
structure = {{k: extra[k] for k in ("diagonal", "window") if k in extra}}
if "documents" in extra:
    ids = documents_of(extra["documents"])
    if extra.get("shuffled"):
        ids = ids[:, torch.randperm(ids.shape[1])]
    structure["q_documents"] = structure["k_documents"] = ids
ops, bias = quantized_operands(b, h, hkv, nq, nk, d, p_mode, bias_kind, dv=extra.get("dv"))
dv = ops[2].shape[-2]
# Allocated as the op does ([B, N, H, Dv] storage), poisoned.
out = torch.full((b, nq, h, dv), float("nan")).transpose(1, 2)
lse, row_ref = (torch.full((b, h, nq), float("nan")) for _ in range(2))
ref_o, ref_l, ref_r = R.attention_forward(*ops, bias, causal, p_mode, torch.float32, **structure)
# Key-padding rows with and without the skipping of their wholly masked tiles; the rest as shipped.
for skip in (False, True) if bias_kind in ("keypad", "leftpad", "rightpad") else (True,):
    attention_fwd.key_bias.TRITON_SKIPS_MASKED_TILES = skip
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    row_ref.fill_(float("nan"))
    attention_fwd.attention_forward(*ops, bias, causal, p_mode, out, lse, row_ref, **structure)
    assert not out.isnan().any() and not lse.isnan().any(), ("unwritten or NaN output", skip)
    assert torch.equal(row_ref, ref_r), ("row reference differs", skip)
    assert torch.equal(lse == float("-inf"), ref_l == float("-inf")), ("empty rows differ", skip)
    live = ref_l > float("-inf")
    assert not live.any() or (lse[live] - ref_l[live]).abs().max() <= 1e-5, ("LSE off: a P code differs", skip)
    assert (out.double() - ref_o.double()).norm() <= 1e-5 * ref_o.double().norm(), ("output off", skip)
"""


@pytest.mark.parametrize("case", FORWARD_CASES, ids=[_case_id(c) for c in FORWARD_CASES])
def test_triton_forward_matches_reference(case, fresh_seed):
    """The Triton forward kernel under the interpreter (its PTX-only steps emulated):
    row references exact, the same empty rows, LSE and output as the reference's, for
    padded head dims, D_qk != D_v, every P mode and the causal structures."""
    _interpreted(FORWARD_SCRIPT.format(seed=fresh_seed, case=case))


TRANSPOSE_SCRIPT = """
import torch
from fp4_inductor import formats as F
from fp4_inductor.kernels.triton import attention_bwd_prep as A
torch.manual_seed({seed})
# [B, H, N, D] views as the op hands them over: contiguous, [B, N, H, D] storage, and
# token-major (unit stride along N); odd N; both 8-bit formats; one batch size, as in a
# backward call, with different heads, lengths and tile counts in the same launch.
views = [(torch.randn(2, 3, 203, 64) * 4).to(F.E5M2),
         (torch.randn(2, 130, 2, 128) * 4).to(F.E4M3).transpose(1, 2),
         (torch.randn(2, 1, 64, 77) * 4).to(F.E4M3).transpose(-1, -2)]
for pairs in ([0], [2, 0], [0, 1, 2], [1, 2, 0, 1]):
    xs = [views[i] for i in pairs]
    ts = [A._token_major_empty(x) for x in xs]
    for t in ts:
        t.view(torch.uint8).fill_(0xAA)  # poison: every byte must be written
    A._transpose_all(list(zip(xs, ts)))
    for x, t in zip(xs, ts):
        assert t.stride(-2) % 16 == 0, t.stride()
        assert torch.equal(t.view(torch.uint8), x.transpose(-1, -2).view(torch.uint8))
    backs = [t.new_empty(x.shape) for x, t in zip(xs, ts)]
    A._transpose_all(list(zip(ts, backs)))
    for x, back in zip(xs, backs):
        assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
"""


def test_token_major_copies_are_exact(fresh_seed):
    """The launcher's tiled byte transposes (token-major operands, V back to row-major),
    one to four in a launch, under Triton's interpreter: bit-exact for every operand layout
    the op passes, odd lengths, copies of different sizes sharing the grid."""
    _interpreted(TRANSPOSE_SCRIPT.format(seed=fresh_seed))


FOLD_SCRIPT = """
import torch
from bwd_checks import check, operands_of, run
from fp4_inductor import formats as F, reference as R
torch.manual_seed({seed})
# Rows whose codes tell the two roundings apart: one nonzero channel, so a row's scores
# are a * b for the 255 keys b = -127..127, and t = q_scale * log2e (K's scale 1).
keys = torch.arange(-127, 128, dtype=torch.float32)
qs_found, a_found = [], []
while len(qs_found) < 64:
    qs = torch.rand(20000) * 0.05 + 0.001
    a = torch.randint(1, 128, (20000,)).float()
    s = a[:, None] * keys[None, :]
    t = qs * F.LOG2E
    m = torch.ceil((s * t[:, None]).amax(1, keepdim=True))
    folded = F.direct_p_codes(s.double() * t.double()[:, None], m)
    rounded = F.direct_p_codes(s * t[:, None], m)
    rows = (folded != rounded).any(1)
    qs_found += qs[rows].tolist()
    a_found += a[rows].tolist()
nq, nk, d = 64, keys.numel(), 64
q8 = torch.zeros(1, 1, nq, d, dtype=torch.int8)
q8[..., 0] = torch.tensor(a_found[:nq]).to(torch.int8)
k8 = torch.zeros(1, 1, nk, d, dtype=torch.int8)
k8[..., 0] = keys.to(torch.int8)
qs = torch.tensor(qs_found[:nq]).view(1, 1, nq)
ks = torch.ones(1, 1, (nk + 127) // 128)
vt = (torch.randn(1, 1, d, nk) * 100).to(F.E4M3)
ops = operands_of((q8, k8, vt, qs, ks, torch.ones(1, 1)), None, False, "direct")
grads, dumps = run(ops, False, "direct", device="cpu")
check(ops, False, "direct", grads, dumps)  # P codes bit for bit, among the rest
x = R.log2_scores(q8, k8, qs, ks, None, False, slice(0, nk))
row_ref = ops[-1][..., None]
assert torch.equal(dumps[0], R._probability(x, row_ref, "direct"))
assert not torch.equal(dumps[0], R._probability(x.float(), row_ref, "direct"))
"""


def test_direct_p_takes_the_unrounded_product(fresh_seed):
    """Direct-P's FMA takes s * t unrounded (``reference.log2_scores``): on rows built so
    that rounding the product first changes codes, the Triton backward kernels' P (and the
    rest of the GPU tests' rules) match the reference, and would not with a rounded
    product."""
    _interpreted(FOLD_SCRIPT.format(seed=fresh_seed))


def test_gluon_direct_p_bias_is_plain_arithmetic_on_torch_tensors(fresh_seed):
    """The Gluon dK/dV launcher evaluates the kernels' Direct-P bias on torch tensors
    (``_direct_p_bias.fn``), once per query: it must stay plain arithmetic and give
    (120 - 8 m) / 256 rounded once, as the kernels compute it per row."""
    pytest.importorskip("triton.experimental.gluon")
    import torch

    from fp4_inductor import formats as F
    from fp4_inductor.kernels.gluon.attention_fwd import _direct_p_bias

    m = torch.cat([torch.randn(4096) * 30, torch.randint(-300, 300, (4096,)).float(), torch.tensor([0.0, -0.0, 15.0])])
    want = ((F.FP8_P_CODE_AT_MAX - 8.0 * m.double()) / 256).float()
    assert torch.equal(_direct_p_bias.fn(m), want)


@pytest.mark.parametrize("nq", [200, 256])
def test_gluon_dkdv_row_vectors_follow_the_query_rows_order(nq, fresh_seed):
    """The Gluon dK/dV launcher hands the kernel Q and dO rows through a 5-D TMA box
    (``_permuted_rows``) and the per-query vectors through a flat one (``_row_vectors``):
    the vectors' position p of a tile must belong to the query whose row the box puts at
    p, as the box's strides say, with whole zero-padded tiles per head."""
    pytest.importorskip("triton.experimental.gluon")
    import torch
    from triton.experimental.gluon import language as gl

    from fp4_inductor.kernels.gluon import attention_bwd_dkdv as K

    b, h, d, bm = 2, 3, 64, 128
    q = torch.randint(-127, 128, (b, h, nq, d), dtype=torch.int8)
    vectors = [torch.rand(b, h, nq) + 0.5 for _ in range(3)]
    padded = K._padded_rows(q, bm)
    n_pad = padded.shape[2]
    assert n_pad % bm == 0 and torch.equal(padded[:, :, :nq], q) and not padded[:, :, nq:].any()
    assert (padded is q) == (nq % bm == 0)

    box = K._permuted_rows(padded, bm, gl.int8)
    row_strides = [st // d for st in box.strides[1:4]]  # in rows, within a 16-row chunk
    within = [sum(i * st for i, st in zip(idx, row_strides)) for idx in itertools.product(*map(range, box.shape[1:4]))]
    order = torch.tensor([16 * c + w for c in range(n_pad // 16) for w in within])  # query at each position
    rows_desc, n_rows = K._row_vectors(*vectors, bm)
    rows = rows_desc.base.reshape(b, h, 3, n_rows)
    assert n_rows == n_pad
    for i, v in enumerate((vectors[0] * K.F.LOG2E, K._direct_p_bias.fn(vectors[1]), vectors[2])):
        want = torch.nn.functional.pad(v, (0, n_pad - nq))[..., order]
        assert torch.equal(rows[:, :, i], want), f"vector {i}"


QUANTIZE_SCRIPT = """
import torch
from fp4_inductor import formats as F
from fp4_inductor.kernels.triton import quantize as Q
torch.manual_seed({seed})
# Head dims that are not powers of two, D_v of its own, strided views, and V holding an
# Inf and a NaN (its scale skips them; they become V's NaN code, as formats.quantize_v).
for b, h, hkv, nq, nk, d, dv in [(1, 4, 2, 70, 300, 80, 80), (2, 2, 1, 33, 128, 40, 40), (1, 1, 1, 20, 200, 192, 128)]:
    q = torch.randn(b, nq, h, d).transpose(1, 2)
    k = torch.randn(b, hkv, nk, d) * 2 + 1
    v = torch.randn(b, hkv, nk, dv)
    v[0, 0, 5, 3], v[-1, -1, nk - 1, dv - 1] = float("inf"), float("nan")
    got, want = Q.quantize_inputs(q, k, v, 0.125), F.quantize_inputs(q, k, v, 0.125, "fp8")
    for name, g, w in zip(("q8", "k8", "v_t", "q_scale", "k_scale", "v_scale"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if name == "k8":  # K's mean is summed in another order: a code may move by one step
            assert (g.int() - w.int()).abs().max() <= 1 and (g != w).float().mean() <= 1e-3, name
        elif name == "k_scale":
            torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
        else:
            assert torch.equal(g.view(torch.uint8) if g.dtype == F.E4M3 else g,
                               w.view(torch.uint8) if w.dtype == F.E4M3 else w), name
"""


def test_triton_quantize_matches_formats(fresh_seed):
    """The quantization kernel under the interpreter against formats.quantize_inputs: padded
    head dims, D_v != D_qk, the spare scale block, non-finite V."""
    _interpreted(QUANTIZE_SCRIPT.format(seed=fresh_seed))


QUANTIZE_EDGES_SCRIPT = """
import torch
from fp4_inductor import formats as F
from fp4_inductor.kernels.triton import quantize as Q
torch.manual_seed({seed})
# fp16 and fp32 inputs; NaN in Q and in K, and an all-zero Q row (scale 1), as the GPU
# tests (test_quantize_gpu.py) check them, bf16 too.
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    q, k, v = (torch.randn(1, 2, n, 64, dtype=dtype) * 3 + 0.5 for n in (70, 150, 150))
    q[0, 0, 5, 3], k[0, 1, 7, 0] = float("nan"), float("nan")
    q[0, 1, 9] = 0
    got, want = Q.quantize_inputs(q, k, v, 0.125), F.quantize_inputs(q, k, v, 0.125, "fp8")
    q8, k8, vt, qs, ks, vs = got
    torch.testing.assert_close(qs, want[3], rtol=0, atol=0, equal_nan=True)
    assert qs[0, 1, 9].item() == 1.0 and qs[0, 0, 5].isnan(), dtype
    assert torch.equal(q8[0, 1], want[0][0, 1]) and torch.equal(vt.view(torch.uint8), want[2].view(torch.uint8))
    torch.testing.assert_close(ks, want[4], rtol=1e-6, atol=0, equal_nan=True)
    assert ks[0, 1, 0].isnan() and not ks[0, 0].isnan().any(), dtype  # the NaN key's block only
    assert torch.equal(vs, want[5]), dtype
"""


def test_triton_quantize_edge_inputs(fresh_seed):
    """The quantization kernel under the interpreter on fp16/fp32 inputs, NaN in Q and K and
    an all-zero Q row, against formats (the GPU tests' checks, on the CPU)."""
    _interpreted(QUANTIZE_EDGES_SCRIPT.format(seed=fresh_seed))


FORWARD_OPTIONS_SCRIPT = """
import torch
from helpers import quantized_operands
from fp4_inductor import formats as F, reference as R
from fp4_inductor.kernels.triton import attention_fwd
torch.manual_seed({seed})


def run(ops, bias, causal, p_mode, out_dtype=torch.float32, **kw):
    b, h, nq, _ = ops[0].shape
    out = torch.full((b, nq, h, ops[2].shape[-2]), float("nan"), dtype=out_dtype).transpose(1, 2)
    lse, row_ref = (torch.full((b, h, nq), float("nan")) for _ in range(2))
    attention_fwd.attention_forward(*ops, bias, causal, p_mode, out, lse, row_ref, **kw)
    return out, lse, row_ref


def close(got, ref, out_tol=1e-5):
    (o, l, r), (ro, rl, rr) = got, ref
    assert torch.equal(r, rr) and (l - rl).abs().max() <= 1e-5
    assert (o.double() - ro.double()).norm() <= out_tol * ro.double().norm()


# The GPU tests' launch options on the CPU: tile configs and natural P order give the
# reference's numbers; bf16/fp16 outputs are within one rounding of it.
ops, bias = quantized_operands(1, 2, 1, 150, 260, 64, "direct", "keypad")
ref = R.attention_forward(*ops, bias, True, "direct", torch.float32)
for kw in (dict(config=(64, 4, 2, None)), dict(perm_p=False)):
    close(run(ops, bias, True, "direct", **kw), ref)
for out_dtype in (torch.bfloat16, torch.float16):
    out, lse, row_ref = run(ops, bias, True, "direct", out_dtype)
    eps = torch.finfo(out_dtype).eps
    assert out.dtype == out_dtype and ((out.float() - ref[0]).abs() <= eps * ref[0].abs() + 1e-6).all(), out_dtype
# NaN in Q or K reaches the outputs the reference's do, through the scales.  (NaN in V
# is left to test_kernels_gpu.py: the interpreter's float8 loads turn V's NaN code finite.)
for where in range(2):
    x = [torch.randn(1, 2, 140, 64), torch.randn(1, 1, 140, 64), torch.randn(1, 1, 140, 64)]
    x[where][0, 0, 37, 5] = float("nan")
    ops = F.quantize_inputs(*x, 0.125, "fp8")
    got, want = run(ops, None, False, "direct"), R.attention_forward(*ops, None, False, "direct", torch.float32)
    assert want[0].isnan().any()
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan()), where
# Scores of 1e4 and more: finite, as the reference.
base = torch.randn(1, 1, 1, 64)
q, k = base * 100 + torch.randn(1, 2, 130, 64), base * 100 + torch.randn(1, 2, 130, 64) * 8
for p_mode in F.P_MODES:
    ops = F.quantize_inputs(q, k, torch.randn(1, 2, 130, 64), 1.0, "fp4" if p_mode == "fp4" else "fp8")
    assert R.log2_scores(*ops[:2], ops[3], ops[4], None, False, slice(0, 130)).abs().max() >= 1e4
    got = run(ops, None, False, p_mode)
    assert all(t.isfinite().all() for t in got), p_mode
    close(got, R.attention_forward(*ops, None, False, p_mode, torch.float32), 1e-3 if p_mode == "exp" else 1e-5)
"""


def test_triton_forward_launch_options_and_edge_inputs(fresh_seed):
    """The Triton forward under the interpreter with ``config=`` and ``perm_p=False``,
    bf16/fp16 outputs, NaN in Q and K and scores of 1e4 (the GPU tests' cases, on the CPU)."""
    _interpreted(FORWARD_OPTIONS_SCRIPT.format(seed=fresh_seed))


SWEEP_SCRIPT = """
import torch
from bwd_checks import check, operands, run
from helpers import quantized_operands
from fp4_inductor import reference as R
from fp4_inductor.kernels.triton import attention_fwd
torch.manual_seed({seed})
# Every head dim the issue names, one small causal case each, forward and backward.
for d in (32, 40, 72, 80, 96, 160, 256):
    ops, _ = quantized_operands(1, 1, 1, 70, 130, d, "direct")
    out = torch.full((1, 70, 1, d), float("nan")).transpose(1, 2)
    lse, row_ref = (torch.full((1, 1, 70), float("nan")) for _ in range(2))
    attention_fwd.attention_forward(*ops, None, True, "direct", out, lse, row_ref, diagonal=60)
    ref_o, ref_l, ref_r = R.attention_forward(*ops, None, True, "direct", torch.float32, 60)
    assert torch.equal(row_ref, ref_r) and (lse - ref_l).abs().max() <= 1e-5, d
    assert (out - ref_o).norm() <= 1e-5 * ref_o.norm(), d
    bops = operands(1, 1, 1, 70, 130, d, "direct", True, diagonal=60)
    grads, dumps = run(bops, True, "direct", device="cpu", diagonal=60)
    check(bops, True, "direct", grads, dumps, diagonal=60)
"""


def test_triton_kernels_at_every_head_dim(fresh_seed):
    """The forward and backward kernels at D = 32, 40, 72, 80, 96, 160, 256 (padded tiles)
    against the reference, under the interpreter."""
    _interpreted(SWEEP_SCRIPT.format(seed=fresh_seed))


TILE_RANGES_SCRIPT = """
import math, torch
from fp4_inductor.formats import MASKED_LOG2
from fp4_inductor.kernels.triton import key_bias
from triton.runtime.interpreter import InterpretedFunction
assert isinstance(key_bias._tile_ranges, InterpretedFunction), "not interpreted"
torch.manual_seed({seed})
nk, bn = 1000, 128  # 8 tiles, the last one partial
keys = torch.arange(nk)
rows = torch.zeros(8, nk)
rows[0, 700:] = MASKED_LOG2  # right padding
rows[1, :300] = MASKED_LOG2  # left padding
rows[2] = MASKED_LOG2  # no key
rows[3] = torch.randn(nk) * 3  # a general bias row
rows[3, 100:400] = MASKED_LOG2
rows[4, :130] = MASKED_LOG2  # a NaN among masked keys keeps its tile
rows[4, 900:] = MASKED_LOG2
rows[4, 950] = float("nan")
rows[5, 3 * bn:4 * bn] = MASKED_LOG2  # zero tiles on both sides of a masked one: no run
rows[6, :] = float("-inf")
rows[6, 256:384] = 0.0
# rows[7]: all zero, the partial tile too (its missing keys count as masked, not zero)
got = key_bias.tile_ranges(rows, bn)
tiles = math.ceil(nk / bn)
for r in range(rows.shape[0]):
    padded = torch.full((tiles * bn,), MASKED_LOG2)
    padded[:nk] = rows[r]
    t = padded.view(tiles, bn)
    kept = [bool(((x > MASKED_LOG2) | x.isnan()).any()) for x in t]
    zero = [bool((x == 0).all()) for x in t]
    lo = min([i for i in range(tiles) if kept[i]], default=tiles)
    hi = max([i + 1 for i in range(tiles) if kept[i]], default=0)
    z = [i for i in range(tiles) if zero[i]]
    z_lo, z_hi = min(z, default=tiles), max([i + 1 for i in z], default=0)
    if len(z) != z_hi - z_lo:
        z_hi = z_lo
    assert got[r].tolist() == [lo, hi, z_lo, z_hi], (r, got[r].tolist(), [lo, hi, z_lo, z_hi])
assert got[0].tolist() == [0, 6, 0, 5] and got[2].tolist()[:2] == [tiles, 0], got
"""


def test_key_bias_tile_ranges(fresh_seed):
    """The Gluon forward's key-bias tile classes (kernels/triton/key_bias.py) under the
    interpreter: right and left padding, no key, a general bias row, NaN among masked keys,
    a zero run broken by a masked tile, -inf biases, a partial last tile."""
    _interpreted(TILE_RANGES_SCRIPT.format(seed=fresh_seed))
