"""What ``calibrate()`` runs on the GPU: each method of an ``Item`` as a step to time.

The steps are the benchmarks' (``benchmarks/bench_attention.py``, ``bench_training.py``,
``lab/explore_masked_sites.py``, ``lab/explore_padded_training.py``), which made the
shipped H200 table: the forward as the quantization op and the forward launcher (and the
launcher alone), a masked forward through ``quantized.quantized_forward``, training through
``lowp_attention`` compiled (Inductor fuses the backward's preparation, as in a model
compiled with the backend), the hybrid path eagerly with ``FP4ATTN_BF16_BACKWARD`` naming
its backward, BF16 as SDPA under ``sdpa_kernel`` (or FlashAttention-4) and masked BF16 as
SDPA on the dense boolean mask.

Nothing here touches CUDA at import; a method that cannot run returns its reason
("not installed: ...", an error) and the run goes on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import traceback

import torch

FA4 = "FlashAttention-4 (flash_attn.cute)"


def median_ms(step, leaves, rep_ms: float) -> float:
    from triton.testing import do_bench

    return do_bench(step, warmup=max(1.0, rep_ms / 3), rep=rep_ms, grad_to_none=leaves, return_mode="median")


def run_item(item, names, timer) -> dict:
    """``calibration.Item``'s methods ``names``:
    {method: {"status": "ok", "ms": ...} or {"status": why not}, each with the wall
    ``seconds`` it took (its compile included)}.  ``timer(step, leaves)``: the median ms of a
    step; None runs each step once (compiling it) without timing."""
    results = {}
    try:
        tensors = _inputs(item)
    except Exception as err:  # out of memory, no CUDA: every method records it
        why = _error(err)
        return {name: {"status": why} for name in names}
    for name in names:
        started = time.perf_counter()
        try:
            made = _setup(item, name, tensors)
            if isinstance(made, str):
                results[name] = {"status": made}
            else:
                step, leaves = made
                step()  # the first call compiles; an error shows here
                torch.cuda.synchronize()
                results[name] = {"status": "ok", "ms": timer(step, leaves) if timer else None}
        except Exception as err:  # recorded; the run goes on
            results[name] = {"status": _error(err)}
            traceback.print_exc(limit=1)
        results[name]["seconds"] = round(time.perf_counter() - started, 3)
        _drop_grads(tensors)
    del tensors
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return results


def _error(err: Exception) -> str:
    return f"error: {type(err).__name__}: {err}"[:400]


def _inputs(item) -> dict:
    """BF16 Gaussian Q, K, V ``[B, H, N, D]`` on the GPU (leaves with gradients in training,
    and dO), seeded per shape; for padding rows ``keep`` ``[B, N]`` (each sequence keeps
    N/2..N keys at its start, "right", or end, "left", seeded as explore_masked_sites.py
    does) and its kernels' bias; for masked rows the dense boolean mask ``[B|1, 1, N, N]``."""
    b, h = item.batch_heads()
    n, d = item.n, item.d
    gen = torch.Generator(device="cuda").manual_seed(n * 131 + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    t = {"q": q, "k": k, "v": v, "keep": None, "bias": None, "dense": None, "dout": None}
    if item.training:
        for name in ("q", "k", "v"):
            t[name].requires_grad_(True)
        t["dout"] = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    if item.mask in ("right", "left"):
        cpu = torch.Generator().manual_seed(d * 10**6 + n * 10 + 2 * item.causal + (item.mask == "left"))
        lengths = torch.randint(n // 2, n + 1, (b,), generator=cpu)
        pos = torch.arange(n) if item.mask == "right" else torch.arange(n).flip(0)
        t["keep"] = (pos[None, :] < lengths[:, None]).cuda()
        from . import formats

        t["bias"] = formats.mask_to_log2_bias(None, t["keep"])
    if item.kind.startswith("masked"):
        rows = torch.arange(n, device="cuda")
        window = item.window
        keys = rows[None, :]
        dense = torch.ones(n, n, dtype=torch.bool, device="cuda")
        if item.causal:
            dense = keys <= rows[:, None]
            if window:
                dense = dense & (keys > rows[:, None] - window)
        dense = dense[None, None]
        t["dense"] = dense if t["keep"] is None else dense & t["keep"][:, None, None, :]
    return t


def _drop_grads(t: dict) -> None:
    for name in ("q", "k", "v"):
        t[name].grad = None


def _setup(item, name: str, t: dict):
    """(step, gradient leaves or None), or why the method cannot run here."""
    if item.kind == "fwd":
        return _forward(item, name, t)
    if item.kind == "masked_fwd":
        return _masked_forward(item, name, t)
    return _training(item, name, t)


def _fp8_reason(q) -> str | None:
    from .kernels import forward_kernel, kernels_run_on

    if not kernels_run_on(q.device) or forward_kernel(q, "direct") is None:
        return "no fp8 kernel for this device (sm_90 and Triton)"
    return None


def _forward(item, name: str, t: dict):
    """As bench_attention.py's "ours-direct+quant" and "ours-direct": the ``fp4attn::quantize``
    op and the forward launcher the ``fp4attn::fwd`` op calls, into outputs laid out as
    the op allocates them; or the launcher alone on quantized operands."""
    from . import ops  # noqa: F401 (registers torch.ops.fp4attn)
    from .kernels import forward_kernel

    q, k, v, causal, scale = t["q"], t["k"], t["v"], item.causal, item.d ** -0.5
    if name.startswith("bf16:"):
        return _bf16(name.removeprefix("bf16:"), causal, (q, k, v), None, training=False)
    why = _fp8_reason(q)
    if why:
        return why
    launch = forward_kernel(q, "direct")
    b, h, n, d = q.shape
    out = torch.empty(b, n, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse, row_ref = (torch.empty(b, h, n, dtype=torch.float32, device=q.device) for _ in range(2))

    def quantize():
        return torch.ops.fp4attn.quantize(q, k, v, scale, "fp8")

    def attend(operands):
        launch(*operands, None, causal, "direct", out, lse, row_ref)
        return out

    if name == "fp8":
        return (lambda: attend(quantize())), None
    operands = quantize()
    return (lambda: attend(operands)), None


def _masked_forward(item, name: str, t: dict):
    from . import quantized

    q, k, v = t["q"], t["k"], t["v"]
    if name == "bf16:dense-mask":  # what such a site falls back to: SDPA on the dense mask
        dense = t["dense"]
        return (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)), None
    why = _fp8_reason(q)
    if why:
        return why
    window = item.window
    bias, causal, scale = t["bias"], item.causal, item.d ** -0.5
    return (lambda: quantized.quantized_forward(q, k, v, bias, scale, causal, "fp8", "direct",
                                                window=window)), None


def _training(item, name: str, t: dict):
    from .attention import lowp_attention

    leaves, dout, causal, keep = (t["q"], t["k"], t["v"]), t["dout"], item.causal, t["keep"]
    if name == "bf16:dense-mask":
        dense = t["dense"]
        return _step(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                     leaves, dout)
    if name.startswith("bf16:"):
        return _bf16(name.removeprefix("bf16:"), causal, leaves, dout, training=True)
    why = _fp8_reason(leaves[0])
    if why:
        return why
    if name == "fp8":
        # Compiled afresh for this shape, static, as a model compiled with the backend
        # runs it: Inductor fuses dO's quantization and the backward's preparation.
        torch._dynamo.reset()
        if keep is None:
            def attend(q, k, v):
                return lowp_attention(q, k, v, is_causal=causal)

            return _step(torch.compile(attend, fullgraph=True, dynamic=False), leaves, dout)

        def attend_padded(q, k, v, keep):
            return lowp_attention(q, k, v, is_causal=causal, key_padding=keep)

        compiled = torch.compile(attend_padded, dynamic=False)
        return _step(lambda q, k, v: compiled(q, k, v, keep), leaves, dout)
    backward = name.split(":")[1]  # the hybrid path: "fp8+bf16bwd:<its BF16 backward>"
    from .kernels import bf16_backward

    if backward == "fa4" and not bf16_backward.has_fa4():
        return f"not installed: {FA4}"
    with _environment("FP4ATTN_BF16_BACKWARD", backward):
        applies = bf16_backward.available(leaves[0].device, item.d, item.d, item.n, item.n, causal, 0, 0,
                                          keep is not None)
    if applies is None:
        return f"no BF16 backward applies: {backward}"
    step, grads = _step(lambda q, k, v: lowp_attention(q, k, v, is_causal=causal, key_padding=keep,
                                                       backward="bf16"), leaves, dout)

    def hybrid():
        with _environment("FP4ATTN_BF16_BACKWARD", backward):
            step()

    return hybrid, grads


def _step(attend, leaves, dout):
    """Forward + backward as a training step runs it: gradients set to None first (as
    ``optimizer.zero_grad()`` does), then stored by autograd."""
    def step():
        for leaf in leaves:
            leaf.grad = None
        attend(*leaves).backward(dout)

    return step, list(leaves)


@contextlib.contextmanager
def _environment(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _bf16(backend: str, causal: bool, qkv, dout, training: bool):
    """BF16 attention by one backend: torch SDPA's cuDNN or flash, or FlashAttention-4."""
    if backend == "fa4":
        try:
            from flash_attn.cute import flash_attn_func
        except ImportError:
            return f"not installed: {FA4}"

        def attend(q, k, v):  # FA4 takes [B, N, H, D]: the transposes are views
            out = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

        def attend(q, k, v):
            with sdpa_kernel(chosen):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if training:
        return _step(attend, qkv, dout)
    if backend == "fa4":
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv)  # [B, N, H, D] storage, as FA4's users

        def forward():
            with torch.inference_mode():
                return attend(q, k, v)

        return forward, None
    return (lambda: attend(*qkv)), None


def _warm_one(item, names) -> None:
    """Run one item's methods once, untimed: their kernels land in the caches on disk."""
    run_item(item, names, None)


def warm_up(work, workers: int, deadline: float) -> int:
    """Compile what ``work`` (``(item, methods)`` pairs) runs in ``workers`` spawned
    processes before the timed loop, so that it finds Triton's and Inductor's caches on
    disk filled; stops at ``deadline`` (``time.monotonic()``), ending the workers.  A
    worker's failure is ignored: the timed loop compiles what is missing and records any
    error.  Returns how many items were compiled."""
    ctx = multiprocessing.get_context("spawn")
    old = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the workers are the parallelism
    try:
        pool = ctx.Pool(workers)
    except Exception:  # no processes here: the timed loop compiles
        return 0
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
        else:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = old
    done = 0
    try:
        pending = [pool.apply_async(_warm_one, (item, tuple(names))) for item, names in work]
        for result in pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                result.get(timeout=remaining)
            except multiprocessing.TimeoutError:
                break
            except Exception:  # noqa: S110 (a worker's error: the timed loop records it)
                pass
            done += 1
    finally:
        pool.terminate()
        pool.join()
    return done

