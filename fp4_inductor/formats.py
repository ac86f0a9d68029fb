"""Quantization numerics: the single source of truth for every kernel and the reference.

Everything here is plain torch code.  These functions are what ``fp4attn::quantize``
computes where no kernel runs, what its Triton kernel must match bit for bit, and, with
``reference.py``, what the attention kernels must compute.

Conventions (both formats):
- Q and K are INT8 (Q per token, smoothed K per 128-token block); V, P, dS are E4M3
  and dO is E5M2.  Scores are handled in log2 units, ``x = s * log2(e)``; the softmax
  scale is folded into Q before quantization, so ``s = (q8 * q_scale) . (k8 * k_scale)``.
- The row reference ``m`` is an integer (``ceil`` of the running row maximum).  Moving
  an integer reference by ``d`` shifts every E4M3 code by ``8 d`` and every E8M0 block
  exponent by ``d``, so probabilities rebuilt in backward against another integer
  reference are the same codes, scaled by an exact power of two.
- A probability operand ``p`` stands for ``2 ** (x - m + LIFT)``; the row sum is the
  sum of those same operand values, so numerator and denominator describe one operator.
"""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP8_MAX = {E4M3: E4M3_MAX, E5M2: E5M2_MAX}
INT8_MAX = 127.0

FORMATS = ("fp8", "fp4")
P_MODES = ("exp", "direct", "fp4")

# Token blocks sharing one K (or E4M3 Q/K view) scale.  Kernels use key tiles of exactly this size
# (the reference emulates the same running-max schedule) and query tiles that divide it.
SCALE_BLOCK = 128
KEY_TILE = 128

# fp8 P: code = 8 (x - m) + 120 puts the row maximum at code 120 = 2**8 (FA3 lifts P by
# 256 too); 0x7F is NaN in E4M3, so codes clamp to [0, 126].
FP8_P_CODE_AT_MAX = 120.0
FP8_P_MAX_CODE = 126.0

# fp4 P: per-32-key E8M0 block exponent, E2M1 payload from the paper's affine classifier
# u = max(0, A x + B), placed inside an E4M3 container lifted by 2**6 (6 * 64 <= 448).
FP4_BLOCK = 32
FP4_AFFINE = (1.50, 1.20)
FP4_CONTAINER_SHIFT = 6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring E2M1 magnitudes; a value exactly on one rounds down.
E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# dS is quantized with one amax scale per (queries, keys) block, a row factor of the
# product that consumes it.  dQ = dS Ke and dK = dS^T Qe run in separate kernels, each
# quantizing the dS it computes: for dQ one scale per query and 128-key tile, for dK one
# per key and query step (``ds_block_dk``).  A line's amax stays within the four threads
# that hold a row of a wgmma tile, where a whole tile's crossed the warpgroup's four warps
# through shared memory and two barriers a step; the gradient error is slightly lower
# than with whole tiles (benchmarks/lab/grad_error_budget.py).
DS_BLOCK_DQ = (1, 128)


def ds_block_dk(head_dim: int) -> tuple[int, int]:
    """dK's dS scale block: one key over the dK/dV kernel's query step, 128 queries up to
    D = 64 (a step's fixed work spread over twice the scores; the registers allow it) and
    64 above (at D = 128 a 128-query step spills)."""
    return (128 if head_dim <= 64 else 64, 1)


# Head dims the ops take (Q/K and V each): every multiple of 8 from 32 to 256.  The
# formats do not depend on it; the Triton kernels run the next power of two at or above
# it (``kernel_head_dim``) with the padding channels masked to zero on load.
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 32, 256, 8


def supported_head_dim(d: int) -> bool:
    return MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_STEP == 0


def kernel_head_dim(d: int) -> int:
    """The power of two a Triton kernel's tiles use for head dim ``d``: Triton's block
    shapes are powers of two, and a zero channel adds nothing to a dot product."""
    return 1 << (d - 1).bit_length()


# ---------------------------------------------------------------- causal structure


def visible(rows: torch.Tensor, cols: torch.Tensor, causal: bool, diagonal: int = 0, window: int = 0
            ) -> torch.Tensor | None:
    """Which (query, key) pairs the causal structure keeps, None for all.

    Causal: key ``j`` is visible to query ``i`` iff ``j <= i + diagonal`` (SDPA's
    ``is_causal`` is diagonal 0, top-left; queries that are the last rows of a longer key
    sequence, as in decode and chunked prefill, have diagonal ``Nk - Nq``).  A window
    ``w > 0`` (sliding-window attention) also needs ``j > i + diagonal - w``: each query
    sees its last ``w`` keys.  ``rows``/``cols``: broadcastable index tensors."""
    if not causal:
        return None
    keep = cols <= rows + diagonal
    if window:
        keep = keep & (cols > rows + diagonal - window)
    return keep


def p_lift(p_mode: str) -> float:
    """log2 of the operand value that stands for probability 1 at the row reference."""
    if p_mode == "fp4":
        return FP4_CONTAINER_SHIFT + math.log2(6.0)
    return 8.0


# ---------------------------------------------------------------- input quantization


def scale_blocks(n: int) -> int:
    """Blocks of per-block scales for ``n`` tokens: ``ceil(n / SCALE_BLOCK)`` and one spare,
    all zeros (scale 1).  The spare keeps the count at 2 or more, which the compiler can
    prove: a count that may be 1 makes it specialise on it (a guard, and a recompile when
    a dynamic length crosses one block)."""
    return (n + SCALE_BLOCK - 1) // SCALE_BLOCK + 1


def _block_view(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """[..., N, D] -> [..., ceil(N / block) + 1, block, D], zero padded (``scale_blocks``)."""
    n = x.shape[-2]
    nb = (n + block - 1) // block + 1
    # Always pad (a zero pad is free): branching on a symbolic length would add a guard.
    x = torch.nn.functional.pad(x, (0, 0, 0, nb * block - n))
    return x.unflatten(-2, (nb, block)), n


def _amax_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    # All-zero blocks get scale 1 so the division stays finite; a NaN or Inf amax stays
    # in the scale, which carries it into the output even through INT8 codes.
    return torch.where(amax == 0, torch.ones_like(amax), amax / fmax)


def _per_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` in units of its (broadcast) scale, as the kernels compute it: one IEEE division
    per scale and a multiplication per element (an IEEE division is a long instruction
    sequence on the GPU, a multiplication one instruction)."""
    return x * (1.0 / scale)


def _cast(x: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    # torch's float8 cast is not saturating: clamp first (NaN stays NaN).
    return x.clamp(-fmax, fmax).to(dtype)


def quantize_blockwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-SCALE_BLOCK-token E4M3/E5M2 quantization of ``[B, H, N, D]``.

    Returns the codes, same shape, and float32 scales ``[B, H, scale_blocks(N)]``.
    """
    fmax = FP8_MAX[dtype]
    x = x.float()
    # Tokens' amaxes first, blocks of those after: only the [..., N] amaxes are padded.
    # (Padding x itself, as _block_view does, made Inductor 2.11 fail an assertion when
    # compiling this in a backward graph with dynamic shapes.)
    token_amax, _ = _block_view(x.abs().amax(dim=-1, keepdim=True), SCALE_BLOCK)
    scale = _amax_scale(token_amax.amax(dim=(-2, -1)), fmax)
    return _cast(x / expand_block_scale(scale, x.shape[-2])[..., None], dtype, fmax), scale


def fold_scale(q: torch.Tensor, sm_scale) -> torch.Tensor:
    """Q times a softmax scale the ops cannot take (a tensor, or a symbolic float that would
    specialise the graph), rounded once to Q's dtype: far below Q's INT8 step, and every
    path (FP8, hybrid, by length, BF16 causal) then sees the same Q and a scale of 1."""
    return (q.float() * sm_scale).to(q.dtype)


def quantize_q(q: torch.Tensor, sm_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Q times the softmax scale as INT8 with one scale per token.

    INT8 rather than E4M3 for the score product: on Gaussian inputs E4M3 Q/K alone
    cost 0.039 rel-L2 of the output, INT8 0.012 (docs/perf-notes/), Hopper runs both
    at the same tensor-core rate, and the int32 accumulation is exact, so backward
    recomputes bit-identical scores in any order.  A per-token scale costs nothing:
    the kernel multiplies each score row by its row scale anyway.
    """
    x = q.float() * sm_scale
    scale = _amax_scale(x.abs().amax(dim=-1), INT8_MAX)
    return _round_int8(_per_scale(x, scale[..., None])), scale


# Tokens K's smoothing mean is taken over, spread evenly over the sequence (all of a shorter one).
K_MEAN_SAMPLES = 128


def smooth_k(k: torch.Tensor) -> torch.Tensor:
    """Subtract a mean of K over tokens: every score in a row moves by the same q.mean,
    which softmax ignores, and outlier channels stop dominating the block scales.

    Any vector shared by a head's keys leaves the softmax alone; the mean of
    ``K_MEAN_SAMPLES`` tokens spread over the sequence rather than of all of them lets the
    quantization kernel read K once (a small kernel reads the samples first).  With rotary
    embeddings a local mean (the first block's) would be worse than none; the spread
    sample is within 0.0007 rel-L2 of the full mean on Gaussian, rotary and MiniLM inputs
    (benchmarks/lab/explore_k_smoothing.py)."""
    return k.float() - k_smoothing_mean(k)


def k_smoothing_mean(k: torch.Tensor) -> torch.Tensor:
    """The mean ``smooth_k`` subtracts, float32 ``[B, Hkv, 1, D]``."""
    n = k.shape[-2]
    count = min(n, K_MEAN_SAMPLES)
    rows = torch.arange(count, device=k.device) * n // count
    return k[..., rows, :].float().mean(dim=-2, keepdim=True)


def smoothing_shift(q: torch.Tensor, k: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """What ``smooth_k`` took off every score of a row, ``sm_scale * q . mean``, float32
    ``[B, H, Nq]``: the forward's LSE (of the smoothed scores) plus this is the LSE of
    the real scores, which a backward recomputing P from the unsmoothed Q and K needs."""
    mean = k_smoothing_mean(k)
    mean = mean.repeat_interleave(q.shape[1] // k.shape[1], dim=1) if k.shape[1] != q.shape[1] else mean
    return (q.float() @ mean.transpose(-1, -2)).squeeze(-1) * sm_scale


def quantize_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Smoothed K as INT8 with one scale per SCALE_BLOCK tokens (a scalar per key tile)."""
    xb, n = _block_view(smooth_k(k), SCALE_BLOCK)
    scale = _amax_scale(xb.abs().amax(dim=(-2, -1)), INT8_MAX)
    return _round_int8(_per_scale(xb, scale[..., None, None])).flatten(-3, -2)[..., :n, :], scale


def _round_int8(x: torch.Tensor) -> torch.Tensor:
    # NaN has no INT8 code; the scale (see _amax_scale) carries it instead.
    return torch.round(x).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_q(q8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q8.float() * scale[..., None]


def dequantize_k(k8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return k8.float() * expand_block_scale(scale, k8.shape[-2])[..., None]


def quantize_v(v: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """V as E4M3 values stored K-major (``[B, H, D, N]``) with one scale per head.

    One scale per head because forward contracts V over tokens and backward over
    channels: a per-token or per-channel scale would sit inside one of the two sums.
    ``fmt="fp4"`` stores exact MXFP4 values (E2M1 times a per-32-token E8M0 scale) in the
    E4M3 container: exact unless a block lies 2**15 below the head's largest block.
    """
    vf = v.float()
    if fmt == "fp4":
        vf = mxfp4_round(vf)
    amax = finite_amax(vf, dim=(-2, -1))
    if fmt == "fp4":
        exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
        scale = torch.exp2(exp)  # container holds at most 6: exact E2M1 times 2**k
    else:
        scale = _amax_scale(amax, E4M3_MAX)
    # An Inf or NaN element becomes the NaN code (the cast keeps NaN; Inf would saturate).
    scaled = torch.where(torch.isfinite(vf), _per_scale(vf, scale[..., None, None]), math.nan)
    codes = _cast(scaled, E4M3, E4M3_MAX)
    return codes.transpose(-1, -2).contiguous(), scale


def finite_amax(x: torch.Tensor, dim) -> torch.Tensor:
    """The largest finite |x| (0 where none).  V's scale spans a whole head: an Inf or NaN
    in it would poison every column of the head, where eager's is non-finite in one
    column only; the element itself becomes V's NaN code, which makes exactly that column
    of the output NaN (eager: Inf or NaN there)."""
    return amax_or_zero(torch.where(torch.isfinite(x), x.abs(), 0.0), dim)


def amax_or_zero(x: torch.Tensor, dim) -> torch.Tensor:
    """``x.amax(dim)``, and 0 over no element (no query or no key: SDPA's answer is then
    zeros, which any scale gives, where torch's amax refuses an empty reduction).  A
    symbolic length is at least 2 (Dynamo specialises 0 and 1): no guard."""
    dims = (dim,) if isinstance(dim, int) else dim
    if any(statically_known_true(x.shape[d] == 0) for d in dims):
        return x.sum(dim=dim)  # the sum of nothing: zeros of the reduced shape
    return x.amax(dim=dim)


def quantize_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale, fmt: str):
    """The forward op's operands ``(q8, k8, v_t, q_scale, k_scale, v_scale)`` from Q, K, V."""
    q8, q_scale = quantize_q(q, sm_scale)
    k8, k_scale = quantize_k(k)
    v_t, v_scale = quantize_v(v, fmt)
    return q8, k8, v_t, q_scale, k_scale, v_scale


def e2m1_round(u: torch.Tensor) -> torch.Tensor:
    """Round non-negative values to the nearest E2M1 magnitude (ties round down)."""
    out = torch.zeros_like(u)
    for boundary, lo, hi in zip(E2M1_BOUNDARIES, E2M1_VALUES[:-1], E2M1_VALUES[1:]):
        out = out + torch.where(u > boundary, hi - lo, 0.0)
    return torch.where(torch.isnan(u), u, out)


def mxfp4_round(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 values of ``[..., N, D]``: blocks of 32 tokens per channel share an E8M0
    exponent chosen so the block maximum is at most 6."""
    xb, n = _block_view(x, FP4_BLOCK)
    amax = finite_amax(xb, dim=-2).unsqueeze(-2)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    scale = torch.exp2(exp)
    q = torch.sign(xb) * e2m1_round(xb.abs() / scale)
    q = torch.where(torch.isfinite(xb), q * scale, xb)  # a non-finite value stays itself
    return q.flatten(-3, -2)[..., :n, :]


def quantize_do(do: torch.Tensor, lse: torch.Tensor, row_ref: torch.Tensor, p_mode: str, codes: torch.dtype = E5M2
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """dO for backward, E5M2 (``codes``: E4M3 for the one-kernel backward) with one scale
    per head (it is contracted over channels in dP = dO V^T and over tokens in dV = P^T dO).
    With the per-head scale E4M3's third mantissa bit is worth more than E5M2's range:
    gradients 0.048-0.051 (dQ, dK) and 0.039-0.043 (dV) against fp64 where E5M2 gives
    0.065-0.069 and 0.059-0.062 (one-kernel numerics, CPU, perf-notes "v7"), at a flush to
    zero of 2-4e-4 of Gaussian dO's values.

    Rows are first multiplied by ``backward_row_factor``, which turns the probability
    operand rebuilt against the forward's row reference into the normalized probability,
    so it never touches the P codes.  Returns (codes, scale).
    """
    fmax = FP8_MAX[codes]
    dof = do.float() * backward_row_factor(lse, row_ref, p_mode)[..., None]
    scale = _amax_scale(amax_or_zero(dof.abs(), (-2, -1)), fmax)
    return _cast(dof / scale[..., None, None], codes, fmax), scale


def backward_row_factor(lse: torch.Tensor, row_ref: torch.Tensor, p_mode: str) -> torch.Tensor:
    """``2 ** (R - LIFT - lse2)``: P rebuilt against the forward's integer row reference R
    (the ceiling of the row's largest log2 score, as the forward builds its codes) times
    this is the normalized probability.  Against R rather than ceil(lse2) the codes stay
    in E4M3's normal range however many keys share the row (perf-notes: gradient error
    by sequence length)."""
    factor = torch.exp2(row_ref - p_lift(p_mode) - lse * LOG2E)
    return torch.where(lse == -math.inf, 0.0, factor)  # an empty row has no gradient


def expand_block_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Per-block scales ``[..., nb]`` repeated to one per token ``[..., n]``."""
    return scale.repeat_interleave(SCALE_BLOCK, dim=-1)[..., :n]


def dequantize_blockwise(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * expand_block_scale(scale, codes.shape[-2])[..., None]


def backward_operands(q8, q_scale, k8, k_scale):
    """E4M3 views of Q and K for dK = dS^T Q and dQ = dS K (dS is E4M3, and one tensor
    core product cannot mix INT8 and FP8), derived from the saved INT8 codes."""
    qe, qe_scale = quantize_blockwise(dequantize_q(q8, q_scale))
    ke, ke_scale = quantize_blockwise(dequantize_k(k8, k_scale))
    return qe, qe_scale, ke, ke_scale


def backward_operands_in_place_of_codes(q8, q_scale, k8, k_scale, codes_scale):
    """``backward_operands`` for a call that passed the forward's INT8 codes in their place
    (the one-kernel backward's operands) but runs another kernel: the E4M3 copies, Ke's
    scales times the factor the caller folded into K's (``codes_scale / k_scale``: the
    softmax scale, within an ulp of the one a caller folds into Ke's own)."""
    qe, qe_scale, ke, ke_scale = backward_operands(q8, q_scale, k8, k_scale)
    return qe, qe_scale, ke, ke_scale * (codes_scale / k_scale)


# ---------------------------------------------------------------- probability operands


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """float32 value of non-negative E4M3 codes 0..126 (given as float integers)."""
    return code.to(torch.uint8).view(E4M3).float()


def direct_p_codes(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Direct-P: E4M3 code from the log2 score with one FMA and a clamp.

    The E4M3 bit pattern read as an integer is 8 log2(value) + 56 at every power of two
    and linear in between, so ``8 (x - m) + 120`` is the code of ``2 ** (x - m + 8)``
    up to the piecewise-linear error (at most +6.1 %, one-sided).  One float32 rounding
    of ``8 x + 120 - 8 m``: the sum is formed in float64, then rounded once (``x``:
    float32, or ``reference.log2_scores``'s exact float64 product, which the kernels' FFMA
    takes unrounded).  The float64 sum is exact while the product's 46 significant bits
    and the integer share 53 (log2 scales t above about 2**-26); below, a double rounding
    is possible but needs a float64 tie, in practice never.
    """
    t = (x.double() * 8.0 + (FP8_P_CODE_AT_MAX - 8.0 * m.double())).float()
    return torch.round(t.clamp(0.0, FP8_P_MAX_CODE))


def probability_operand(x: torch.Tensor, m: torch.Tensor, p_mode: str) -> torch.Tensor:
    """The float32 value of the E4M3 P operand fed to the P.V product.

    ``x``: ``[..., rows, keys]`` log2 scores of one key tile (-inf where masked), float32
    or ``reference.log2_scores``'s float64 (Direct-P rounds it once, the other modes round
    it to float32 first); ``m``: ``[..., rows, 1]`` integer row reference with
    ``m >= max(x)``.
    """
    if p_mode == "direct":
        return e4m3_value(direct_p_codes(x, m))
    x = x.float()
    if p_mode == "exp":
        return torch.exp2(x - m + 8.0).to(E4M3).float()
    if p_mode == "fp4":
        return fp4_probability(x, m)
    raise ValueError(f"unknown p_mode {p_mode!r}")


def p_sum_log_bias(p_mode: str) -> float:
    """ln(sum of the represented probabilities / sum of the exact ones) of a row whose
    scores' fractional parts spread evenly (any row of more than a few keys): what the
    forward's LSE exceeds the exact LSE by.  Direct-P's codes lie above 2**x by up to
    6.1 %, 4.0 % on such a row; E4M3 rounding of exp2 is almost unbiased."""
    if p_mode not in _P_SUM_LOG_BIAS:
        raise ValueError(f"no LSE bias for p_mode {p_mode!r} (its blocks' codes depend on their maxima)")
    return _P_SUM_LOG_BIAS[p_mode]


def _measure_p_sum_log_bias(p_mode: str) -> float:
    x = -1.0 - (torch.arange(1 << 16, dtype=torch.float64) + 0.5) / (1 << 16)  # one octave below the reference
    represented = probability_operand(x, torch.zeros(1, dtype=torch.float64), p_mode).double() * 2.0 ** -p_lift(p_mode)
    return math.log(represented.sum().item() / torch.exp2(x).sum().item())


def fp4_probability(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The paper's Direct-P for MXFP4: per 32 keys an E8M0 exponent e from the block
    maximum, then the E2M1 payload q = round(max(0, A xc + B)) with
    ``xc = x - m - e + log2 6``; the container holds ``q * 2 ** (e + 6)``."""
    a, b = FP4_AFFINE
    xb = x.unflatten(-1, (-1, FP4_BLOCK))
    rel = xb - m[..., None]
    e = torch.ceil(rel.amax(dim=-1, keepdim=True))
    live = torch.isfinite(e)
    e = torch.where(live, e, torch.zeros_like(e))
    xc = rel - e + math.log2(6.0)
    q = e2m1_round(torch.clamp(a * xc + b, min=0.0))
    q = torch.where(live & (rel > -math.inf), q, torch.zeros_like(q))
    p = (q * torch.exp2(e + FP4_CONTAINER_SHIFT)).to(E4M3).float()
    return p.flatten(-2)


# Floor of a dS block's scale: float32's smallest normal, so 1 / scale is finite (2**126) and
# the kernels' ds * (1 / scale) needs no NaN guard for blocks of exact zeros (0 * inf).
DS_SCALE_MIN = 2.0**-126


def ds_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale of a dS block of this amax: amax / 448, floored at DS_SCALE_MIN (an
    all-zero block too); a NaN amax stays in the scale."""
    scale = amax / E4M3_MAX
    return torch.where(scale < DS_SCALE_MIN, DS_SCALE_MIN, scale)


def quantize_ds(ds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dS of one scale block (the last two dimensions) as E4M3 with its ``ds_scale``."""
    scale = ds_scale(ds.abs().amax(dim=(-2, -1), keepdim=True))
    return _cast(ds / scale, E4M3, E4M3_MAX).float(), scale


# Finite stand-in (log2 units) for -inf and finfo.min in masks: masked keys get P = 0
# next to any real score.  2**20 keeps 8 x + 120 - 8 m exact in float32, so the codes of
# a row are well defined whatever it holds.
MASKED_LOG2 = -(2.0**20)
# A row whose reference (the ceiling of its largest log2 score) stays below this saw no
# visible key: every key masked (bias at MASKED_LOG2, or -inf from the causal structure).
# Its output is zero and its LSE -inf, as FlashAttention and cuDNN define it;
# ``attention.empty_row_fill`` gives such rows what the replaced code computed.  Real
# scores never come near: it is 3.6e5 in natural-log units.
EMPTY_ROW_LOG2 = MASKED_LOG2 / 2


def mask_to_log2_bias(attn_mask: torch.Tensor | None, key_padding: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
    """The kernels' float32 bias in log2 units from an SDPA-style mask (boolean, True
    keeps, or additive) and a ``[B, Nk]`` key-padding vector (True keeps): MASKED_LOG2
    where masked, so values at or below about -7.3e5 count as masked."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.where(attn_mask, 0.0, MASKED_LOG2)
        else:
            bias = (attn_mask.float() * LOG2E).clamp(min=MASKED_LOG2)
    if key_padding is not None:
        keep = key_padding[:, None, None, :]
        bias = torch.where(keep, 0.0 if bias is None else bias, MASKED_LOG2)
    return bias


# Filled at import, outside any trace: the hybrid path's backward reads it while AOTAutograd
# traces on fake tensors, where the `.item()` of a first fill cannot run (a cache filled
# there sent the whole model to eager in a fresh process).
with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
    _P_SUM_LOG_BIAS = {p_mode: _measure_p_sum_log_bias(p_mode) for p_mode in ("direct", "exp")}
