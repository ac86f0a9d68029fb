"""Helpers shared by the benchmark scripts (inputs, FLOP counts, parallel precompile)."""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")  # where every script writes by default
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from fp4_inductor import formats as F  # noqa: E402

# A peer whose package is missing: recorded in the results, not an error.
NOT_INSTALLED = "not installed"
HBM_BANDWIDTH = 4.26e12  # bytes/s, copy bandwidth measured on the H200: the byte floors' rate


def quantize_floor_us(q_elems: int, kv_elems: int, v_reads: int = 2) -> float:
    """The quantization op's byte floor in microseconds: BF16 Q and K read once, V
    ``v_reads`` times (its per-head scale needs a pass first), 8-bit codes written once;
    ``kv_elems``: K's (and V's) element count."""
    bytes_moved = 2 * q_elems + 2 * kv_elems + 2 * v_reads * kv_elems + q_elems + 2 * kv_elems
    return bytes_moved / HBM_BANDWIDTH * 1e6


def stop(signum, frame):
    """SIGTERM handler: stop like Ctrl-C, so what was measured is saved."""
    raise KeyboardInterrupt


def save(doc, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool) -> float:
    """4 B H Nq Nk D (two GEMMs), half when causal (FA3's convention)."""
    f = 4.0 * b * h * nq * nk * d
    return f / 2 if causal else f


def fa3_shape(n: int, d: int, total_tokens: int = 16384, width: int = 2048) -> tuple[int, int]:
    """(B, H) of FlashAttention-3's benchmark grid: B * N = 16384, H * D = 2048."""
    return max(total_tokens // n, 1), width // d


def quantized_inputs(b, h, hkv, nq, nk, d, p_mode, device="cuda", dtype=torch.bfloat16, sm_scale=None):
    """Gaussian Q, K, V and their quantized forms (formats.py), contiguous as
    ``fp4attn::quantize`` returns them, on ``device``."""
    q = torch.randn(b, h, nq, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    ops = F.quantize_inputs(q, k, v, scale, "fp4" if p_mode == "fp4" else "fp8")
    return (q, k, v), tuple(t.contiguous() for t in ops)


def empty_outputs(b, h, nq, d, dtype=torch.bfloat16, device="cuda", fill=float("nan")):
    """O [B, H, Nq, D] stored [B, Nq, H, D] (as the op allocates it), LSE and row reference,
    poisoned."""
    out = torch.full((b, nq, h, d), fill, dtype=dtype, device=device).transpose(1, 2)
    lse, row_ref = (torch.full((b, h, nq), fill, dtype=torch.float32, device=device) for _ in range(2))
    return out, lse, row_ref


def kernel_ms(prof, calls: int) -> dict:
    """Device ms per call of each kernel among a torch profiler's CUDA events, recorded
    over ``calls`` calls."""
    per_kernel = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time / (1e3 * calls)
    return per_kernel


def kernel_times(fn, calls: int = 5) -> dict:
    """Device ms per call of each kernel ``fn`` launches, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return kernel_ms(prof, calls)


def environment() -> dict:
    try:
        import triton
    except ImportError:  # CPU-only machines: the reference emulation needs no Triton
        triton = None

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__ if triton else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def _compile_one(spec):
    """Run one variant once on a small batch so Triton compiles it into the shared cache."""
    import time

    from fp4_inductor.kernels.triton import attention_fwd as A

    n, d, p_mode, causal, bias_mode, config, options, perm = spec[:8]
    extra = dict(spec[8:])  # optional (name, value) pairs: nk, hkv, out_dtype, use_tma
    nk = extra.get("nk", n)
    out_dtype = getattr(torch, extra.get("out_dtype", "bfloat16"))
    t0 = time.time()
    try:
        torch.manual_seed(0)
        _, (q8, k8, vt, qs, ks, vs) = quantized_inputs(1, 1, 1, n, nk, d, p_mode)
        bias = None
        if bias_mode == 1:
            bias = torch.zeros(1, 1, 1, nk, device="cuda")
        elif bias_mode == 2:
            bias = torch.zeros(1, 1, n, nk, device="cuda")
        out, lse, row_ref = empty_outputs(1, 1, n, d, dtype=out_dtype)
        A.attention_forward(q8, k8, vt, qs, ks, vs, bias, causal, p_mode, out, lse, row_ref, config=config,
                            options=dict(options), perm_p=perm, use_tma=extra.get("use_tma"))
        torch.cuda.synchronize()
        return spec, time.time() - t0, None
    except Exception as err:  # reported by the caller
        return spec, time.time() - t0, f"{type(err).__name__}: {err}"[:400]


def precompile(specs, workers: int = 8):
    """Compile kernel variants in parallel processes (Triton's on-disk cache is shared),
    so the timing loop in the parent finds them compiled.  A spec is (N, D, p_mode,
    causal, bias_mode, config, options as sorted (name, value) pairs, perm_p) followed
    by optional (name, value) pairs (nk, out_dtype, use_tma).  Returns {spec: error}."""
    specs = list(dict.fromkeys(specs))
    ctx = multiprocessing.get_context("spawn")
    errors = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for spec, _, err in pool.map(_compile_one, specs):
            errors[spec] = err
    return errors
