"""Which path each attention site takes, and why.

Support checks come first (anything the low-precision op cannot compute exactly as the
site means it stays as written); then per-site overrides; then the policy: ``never``,
``always`` (low precision wherever supported; on a device without a kernel this runs the
reference emulation), or ``auto``: decisions measured by ``tune()`` on this GPU, else the
cost model over the GPU's measured table (``calibrate()``'s for this GPU and these software
versions, else the one shipped in ``tables/``), else the analytic model fitted to the
shipped tables (``AnalyticModel``), else BF16.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import math
from pathlib import Path

import torch

from . import analytic, cost_tables
from .attention import default_p_mode
from .config import HYBRID, Options
from .cost_tables import gpu_slug  # noqa: F401 (the policy's name for it)
from .formats import HEAD_DIM_STEP, MAX_HEAD_DIM, MIN_HEAD_DIM, supported_head_dim
from .kernels import bf16_backward, kernels_run_on
from .patterns.common import Site, value

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Decision:
    path: str  # config.PATHS: "fp8" | "fp4" | "fp8+bf16bwd" | "bf16"
    reason: str
    predicted_speedup: float | None = None
    # Dynamic key length: low precision only from this many keys, chosen per call.
    min_keys: int | None = None
    # The site as written is outside what any rewrite supports: it stays exactly as it is.
    unsupported: bool = False

    @property
    def low_precision(self) -> bool:
        return self.path != "bf16"


def unsupported_reason(site: Site) -> str | None:
    if site.unsupported:
        return site.unsupported
    q, k, v = (value(n) for n in (site.q, site.k, site.v))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query, key or value is not a tensor"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device.type} is not supported"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (need one of fp16, bf16, fp32)"
    if site.dims is not None:  # nn.MultiheadAttention: the matcher read the head layout
        return _head_dim_reason(site.shape()[-1], site.shape()[-1]) or _mask_grad_reason(site)
    if not (q.dim() == k.dim() == v.dim()) or q.dim() not in (3, 4):
        return "query, key and value must all be 3-d or 4-d"
    d = q.shape[-1]
    if d != k.shape[-1]:
        return "query and key head dims differ"
    reason = _head_dim_reason(d, v.shape[-1])
    if reason is not None:
        return reason
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[-2] != v.shape[-2]:
        return "batch or key-length mismatch between query, key and value"
    if q.dim() == 4 and (k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] != 0):
        return "key/value heads do not divide query heads"
    reason = _mask_grad_reason(site) or _peaked_scale_reason(site.scale, d)
    if reason is not None:
        return reason
    scores = (*q.shape[:-1], k.shape[-2])
    for mask in _mask_values(site, dense=True):
        if mask.dim() > 0 and not _broadcasts(mask.shape, scores):
            return f"mask of shape {tuple(mask.shape)} does not broadcast to scores {tuple(scores)}"
    return None


# Softmax scales beyond this many times 1/sqrt(D) keep BF16.  Such scales make attention
# near one-hot: the output is whichever key scores highest, and 8-bit Q and K (any 8-bit
# format: the scores' rounding error is ~1 % of their size, multiplied by the scale) swap
# near-tied keys, which moves a row by a whole V row.  Gaussian inputs, D 64, N 192, fp8
# rel-L2 against float64: 0.042 at 1x, 0.041 at 8x, 0.050 at 16x, 0.061 at 32x, 0.076 at
# 64x; PyTorch's SDPA test with scale = -1e4 (80000x): 0.14-0.21 with 2-5 of 192 rows on
# another key (issue #61).  Only a constant scale is checked (a tensor or symbolic one
# is not known at compile time).
MAX_SCALE_FACTOR = 16.0


def _peaked_scale_reason(scale, d: int) -> str | None:
    """Why a site whose softmax scale is far above 1/sqrt(D) keeps BF16, or None.  ``scale``
    as a site holds it: None (SDPA's default), a number, a node, or a hand-written site's
    (factor, is_division) pairs."""
    value = scale
    if isinstance(scale, tuple):
        value = 1.0
        for factor, is_div in scale:
            if not isinstance(factor, (int, float)):
                return None
            value = value / factor if is_div else value * factor
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if abs(value) * d**0.5 > MAX_SCALE_FACTOR:
        return (f"softmax scale {value:g} is {abs(value) * d**0.5:.3g}x 1/sqrt(D): near one-hot attention, whose "
                f"8-bit scores swap near-tied keys (kept where |scale| <= {MAX_SCALE_FACTOR:g}/sqrt(D))")
    return None


def _head_dim_reason(d: int, dv: int) -> str | None:
    for name, n in (("head dim", d), ("value head dim", dv)):
        if not supported_head_dim(n):
            return f"{name} {n} is not supported (multiples of {HEAD_DIM_STEP} from {MIN_HEAD_DIM} to {MAX_HEAD_DIM})"
    return None


def _mask_grad_reason(site: Site) -> str | None:
    """A mask or scale whose gradient the low-precision path would drop; only with grad
    enabled (Dynamo guards grad mode: under no_grad a learned mask is data)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in _mask_values(site)):
        return "mask or scale requires grad"
    return None


def _mask_values(site: Site, dense: bool = False) -> list[torch.Tensor]:
    nodes = site.mask_nodes(dense)
    if isinstance(site.scale, tuple) and not dense:
        nodes += [f for f, _ in site.scale]
    return [t for t in (value(n) for n in nodes) if isinstance(t, torch.Tensor)]


def _broadcasts(shape, target) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except RuntimeError:
        return False


# Below this predicted speedup BF16 is kept: a user must never get a slowdown from the
# backend.  On the H200 the measured speedup of the eager low-precision path came out at
# 0.88-1.08x the table's prediction (policy grid, docs/perf-notes/): the table is
# measured on full-GPU shapes, and run-to-run spread alone is up to 5 %.
MIN_SPEEDUP = 1.10
# tune() measures both paths on the real shapes in one process: only its timing spread
# needs covering.
MIN_MEASURED_SPEEDUP = 1.03
# The hybrid path's backward is a BF16 kernel of the class BF16 attention runs: only its
# forward, about 30 % of a training step's attention, can be mispredicted as the eager
# forward was (above), so its margin is that of tune()'s timing spread.
MIN_HYBRID_SPEEDUP = 1.03
_TABLES = Path(__file__).parent / "tables"


@dataclasses.dataclass(frozen=True)
class SiteShape:
    b: int
    h: int
    hkv: int
    nq: int
    nk: int
    d: int
    causal: bool
    training: bool
    dv: int | None = None  # the value head dim where it differs from d
    mask: str = "none"  # Site.mask_kind()
    visible: float | None = None  # the fraction of scores the causal structure keeps, where known

    def flops(self) -> float:
        """Matrix FLOPs: 2 B H Nq Nk (D + Dv) forward over the visible scores (about half
        when causal), 3.5x for fwd+bwd."""
        fraction = self.visible if self.visible is not None else (0.5 if self.causal else 1.0)
        fwd = 2.0 * self.b * self.h * self.nq * self.nk * (self.d + (self.dv or self.d)) * fraction
        return fwd * (3.5 if self.training else 1.0)

    def rate_length(self) -> float:
        """The length of the square site (Nq = Nk, as the cost table was measured) whose
        rates price this one: 2 Nq Nk / (Nq + Nk), the square site with the same tokens to
        quantize per score.  Where Nq and Nk differ, the shorter side bounds both the
        kernel's rows (few keys) or programs (few queries) and the quantization's share.
        The longer length (used before) priced a Wan2.1 cross-attention, 32760 queries over
        512 text keys, at 1.36x BF16; it ran at 0.75x (H200, 2026-12-03)."""
        return 2.0 * self.nq * self.nk / (self.nq + self.nk)

    def quantized_share(self) -> float:
        """The elements this site quantizes over those of the same site with a K/V head per
        query head (as the cost table was measured): GQA and MQA quantize K and V once per
        shared head."""
        return (self.h * self.nq + 2 * self.hkv * self.nk) / (self.h * self.nq + 2 * self.h * self.nk)

    @property
    def masked(self) -> bool:
        """Whether the site has a mask beyond SDPA's own causal structure."""
        return self.mask not in ("none", "causal")

    def table_key(self) -> str:
        """The cost table's key: what changes which kernel runs and how fast.  The
        measured rates are for SDPA's own causal structure or none; masks and other value
        head dims have keys of their own."""
        dims = f"d{self.d}" + (f"v{self.dv}" if self.dv and self.dv != self.d else "")
        key = f"{dims}/{'causal' if self.causal else 'full'}/{'train' if self.training else 'fwd'}"
        mask = self.mask.split(" ")[0]
        if "documents" in self.mask and "documents" not in mask:  # a window's documents: other work
            mask += "+documents"
        return f"{key}/{mask}" if self.masked else key


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Measured throughput per path on one GPU model (a data file in ``tables/``).

    ``rates[path][key]`` lists ``(N, TFLOP/s)`` measured on FlashAttention-3's grid
    (B N = 16k, H D = 2048); low-precision rates include the quantization pass, and
    ``<path>-kernel`` (forward) is the kernels' alone.
    ``launch_us``: fixed cost of the extra kernels of the low-precision path.
    """

    gpu: str
    rates: dict
    launch_us: float
    source: str
    calibrated: bool = False  # measured by calibrate() on this machine

    @classmethod
    def from_json(cls, text: str) -> "CostTable":
        return cls.from_doc(json.loads(text))

    @classmethod
    def from_doc(cls, doc: dict, calibrated: bool = False) -> "CostTable":
        """From a table's JSON object (``cost_tables.check_table`` says what it must hold)."""
        cost_tables.check_table(doc)
        rates = {
            path: {key: sorted((int(n), float(r)) for n, r in points.items()) for key, points in by_key.items()}
            for path, by_key in doc["tflops"].items()
        }
        return cls(gpu=doc["gpu"], rates=rates, launch_us=float(doc["launch_us"]), source=doc.get("source", ""),
                   calibrated=calibrated)

    def rate(self, path: str, shape: SiteShape) -> float | None:
        """TFLOP/s at the shape's ``rate_length``, log-linear between measured lengths.  Below
        the shortest measured length an unmasked site gets that length's rate; a masked one
        gets none, since padding or a window shared by fewer keys is other work (a window
        longer than the row is plain causal)."""
        points = self.rates.get(path, {}).get(shape.table_key())
        if not points:
            return None
        n = shape.rate_length()
        if n < points[0][0] and shape.masked:
            return None
        if n <= points[0][0]:
            return points[0][1]
        if n >= points[-1][0]:
            return points[-1][1]
        for (n0, r0), (n1, r1) in zip(points, points[1:]):
            if n0 <= n <= n1:
                t = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
                return r0 + t * (r1 - r0)
        return None

    @property
    def label(self) -> str:
        return "calibrated cost model" if self.calibrated else "cost model"

    def speedup(self, shape: SiteShape, fmt: str) -> float | None:
        """BF16 time over low-precision time, or None where the table has no rate."""
        low = self.rate(fmt, shape)  # fp4 is ~4x slower than fp8 on Hopper: never stands in for it
        bf16 = self.rate("bf16", shape)
        if low is None or bf16 is None:
            return None
        flops = shape.flops()
        # The table's grid fills the GPU; a small site pays the same wave inefficiency on
        # both paths, plus the low-precision path's fixed launch costs.
        t_bf16 = flops / (bf16 * 1e12)
        t_low = flops / (low * 1e12)
        kernel = self.rate(f"{fmt}-kernel", shape)
        if kernel is not None and kernel > low:  # the quantization's part, for this site's K/V heads
            t_kernel = flops / (kernel * 1e12)
            t_low = t_kernel + (t_low - t_kernel) * shape.quantized_share()
        return t_bf16 / (t_low + self.launch_us * 1e-6)


@dataclasses.dataclass(frozen=True)
class AnalyticModel:
    """The cost model of an sm_90 GPU without a measured table (``analytic``): the shipped
    tables' efficiencies carried to this GPU through its SM count, clock, memory bandwidth
    and tensor-core rate, as a table of the same rows.  It prices every row the shipped
    tables have (forward, training, the hybrid path, masks).  A decision needs the path's
    own margin (``MIN_SPEEDUP``, ``MIN_HYBRID_SPEEDUP``: what a measured table mispredicts)
    or, where wider, ``min_speedup``: 1 + the fit's error on the speedups of the tables it
    was fitted to, for the site's family of rows and length (``analytic.margin``).
    """

    gpu: str
    sms: int
    clock_hz: float
    bandwidth: float  # bytes/s
    table: CostTable
    constants: dict = dataclasses.field(repr=False, compare=False)

    def min_speedup(self, shape: SiteShape, rates: str) -> float:
        """1 + the fit's speedup error for this path at the shape's row family and length
        (its largest error anywhere where it has no such row)."""
        error = analytic.margin(self.constants, rates, shape.table_key(), shape.rate_length())
        return 1.0 + (self.constants["speedup_error"] if error is None else error)

    @classmethod
    def of(cls, device: torch.device) -> "AnalyticModel | None":
        try:
            props = torch.cuda.get_device_properties(device)
        except (RuntimeError, AssertionError, AttributeError, ValueError):  # no CUDA, or not a CUDA device
            return None
        clock_khz, mem_khz, bus_bits = (getattr(props, n, 0) for n in ("clock_rate", "memory_clock_rate",
                                                                        "memory_bus_width"))
        if (props.major, props.minor) != (9, 0) or not (clock_khz and mem_khz and bus_bits):
            return None
        return _analytic_model(props.name, props.multi_processor_count, clock_khz, mem_khz, bus_bits)

    @property
    def label(self) -> str:
        return f"analytic model (no measured table for {self.gpu}; calibrate() measures this GPU)"

    @property
    def source(self) -> str:
        return self.table.source

    def speedup(self, shape: SiteShape, fmt: str) -> float | None:
        return self.table.speedup(shape, fmt)


@functools.cache
def _analytic_model(name: str, sms: int, clock_khz: float, mem_khz: float, bus_bits: int) -> AnalyticModel | None:
    constants = analytic.load_fit()
    if constants is None:
        return None
    hw = analytic.Hardware.of(name, sms, clock_khz, mem_khz, bus_bits)
    table = CostTable.from_doc(analytic.synthesize(hw, constants))
    return AnalyticModel(name, hw.sms, hw.clock_hz, hw.bandwidth, table, constants)


def table_path(gpu_name: str) -> Path:
    return _TABLES / f"{gpu_slug(gpu_name)}.json"


@functools.cache
def table_for(gpu_name: str) -> CostTable | None:
    path = table_path(gpu_name)
    return CostTable.from_json(path.read_text()) if path.exists() else None


def site_shape(site: Site) -> SiteShape | None:
    dims = site.shape()
    if dims is None:
        return None
    v = value(site.v)
    dv = v.shape[-1] if site.dims is None and isinstance(v, torch.Tensor) else dims[-1]
    s = site.structure
    visible = None
    if s is not None and s.causal and all(isinstance(x, int) for x in (s.diagonal[0], s.window)) and not s.diagonal[1]:
        visible = visible_fraction(dims[3], dims[4], s.diagonal[0], s.window)
    return SiteShape(*dims, causal=site.causal, training=site.training(), dv=dv if dv != dims[-1] else None,
                     mask=site.mask_kind(), visible=visible)


def visible_fraction(nq: int, nk: int, diagonal: int, window: int) -> float:
    """The fraction of the Nq x Nk scores that ``formats.visible`` keeps."""
    rows = torch.arange(nq, dtype=torch.float64)
    hi = (rows + diagonal).clamp(max=nk - 1)
    lo = (rows + diagonal - window + 1).clamp(min=0) if window else torch.zeros_like(rows)
    return float((hi - lo + 1).clamp(min=0).sum()) / (nq * nk)


def decide(site: Site, options: Options, tuned: dict | None = None) -> Decision:
    """The path for one site: support, then overrides, then the policy.

    ``tuned``: decisions measured by ``tune()`` for this GPU, keyed by ``site_key``."""
    reason = unsupported_reason(site)
    if reason is not None:
        return Decision("bf16", reason, unsupported=True)
    for pattern, path in options.overrides:
        if fnmatch.fnmatchcase(site.name, pattern):
            return _override(site, f"override {pattern!r} -> {path}", path)
    if options.policy == "never":
        return Decision("bf16", "policy=never")
    device = value(site.q).device
    if options.policy == "always":
        where = "" if kernels_run_on(device) else " (reference emulation: no kernel for this device)"
        return Decision(options.fmt, "policy=always" + where)
    if not kernels_run_on(device):
        return Decision("bf16", "no low-precision kernel for this device")
    shape = site_shape(site)
    keys, queries = site.key_length(), site.query_length()
    key = site_key(site, options.fmt, options.p_mode_for(options.fmt))
    static = not any(isinstance(n, torch.SymInt) for n in (keys, queries))
    if tuned and key in tuned and static:  # measured at this one shape
        entry = tuned[key]
        label = "fp8 fwd, bf16 bwd: " if entry["path"] == HYBRID else ""
        return Decision(entry["path"],
                        f"tuned on this GPU: {label}{entry['speedup']:.2f}x, cosine {entry['cosine']:.4f}",
                        entry["speedup"])
    gpu = torch.cuda.get_device_name(device)
    model = cost_model(device)
    own = _priced(PricedPath(options.fmt), shape, model, gpu, keys, queries)
    backend = hybrid_backend(site, shape) if shape.training and options.fmt == "fp8" else None
    if backend is None:
        return own
    hybrid = _priced(PricedPath(HYBRID, backend), shape, model, gpu, keys, queries)
    if hybrid.low_precision and (not own.low_precision
                                 or prefers_hybrid(hybrid.predicted_speedup, own.predicted_speedup)):
        return hybrid
    if own.low_precision:
        return own
    return dataclasses.replace(own, reason=f"{own.reason}; {hybrid.reason}")


def prefers_hybrid(hybrid_speedup: float, fp8_speedup: float) -> bool:
    """Within timing spread of the FP8 backward the hybrid path wins: its gradients are
    BF16's (0.02 rel-L2 against fp64 where the FP8 backward's are 0.07)."""
    return hybrid_speedup * MIN_MEASURED_SPEEDUP >= fp8_speedup


@dataclasses.dataclass(frozen=True)
class PricedPath:
    """A low-precision path as the cost model prices it: the path a site takes, and the
    BF16 backward the hybrid path's rates were measured with (``kernels.bf16_backward``)."""

    name: str
    backward: str | None = None

    @property
    def rates(self) -> str:
        """The cost table's rows for it: ``fp8``, ``fp4``, ``fp8+bf16bwd:fa4``, ..."""
        return f"{self.name}:{self.backward}" if self.backward else self.name

    @property
    def label(self) -> str:
        return f"fp8 fwd, bf16 bwd ({self.backward})" if self.backward else self.name

    @property
    def min_speedup(self) -> float:
        return MIN_HYBRID_SPEEDUP if self.backward else MIN_SPEEDUP


def _priced(path: PricedPath, shape: SiteShape, model, gpu: str, keys, queries) -> Decision:
    """The cost model's verdict on one path; under dynamic shapes a guard or a run-time
    branch at its crossover."""
    dynamic_keys, dynamic_queries = isinstance(keys, torch.SymInt), isinstance(queries, torch.SymInt)
    decision = cost_model_decision(shape, path, model, gpu)
    if decision.predicted_speedup is None or not (dynamic_keys or dynamic_queries):
        return decision
    if not dynamic_keys:
        # Only the queries vary (a fixed cache): guard on their crossover; a later query
        # length on the other side recompiles with the other path.
        threshold = crossover_length(shape, path, model, vary="queries")
        if threshold is None:
            return decision
        return _verdict(path, decision.predicted_speedup, bool(queries >= threshold),
                        f"; {path.label} from {threshold} queries (a size across the crossover recompiles)",
                        model.label)
    threshold = crossover_length(shape, path, model, vary="both" if dynamic_queries else "keys")
    if threshold is None:
        return decision
    if not shape.training:
        return Decision(path.name, f"{model.label}: {path.label} from {threshold} keys, BF16 below "
                        f"(branch at run time; {decision.predicted_speedup:.2f}x at {shape.nk} keys)",
                        decision.predicted_speedup, min_keys=threshold)
    # The run-time branch has no autograd, so training guards on the symbolic length: a
    # later size on the other side of the crossover recompiles with the other path.
    return _verdict(path, decision.predicted_speedup, bool(keys >= threshold),
                    f"; {path.label} from {threshold} keys (a size across the crossover recompiles)", model.label)


def hybrid_backend(site: Site, shape: SiteShape) -> str | None:
    """The BF16 backward the hybrid path would run at this site (``kernels.bf16_backward``),
    None where none applies its structure exactly (then the path is not offered)."""
    s = site.structure
    if s is not None and s.documents is not None:  # no BF16 backward takes document ids
        return None
    diagonal, window = (0, 0) if s is None else (s.diagonal[0] if not s.diagonal[1] else None, s.window)
    if not isinstance(window, int):
        return None
    nq, nk = shape.nq, shape.nk
    if not (isinstance(nq, int) and isinstance(nk, int)):  # symbolic: square calls only
        if nq is not nk and not (isinstance(diagonal, int) and diagonal == 0):
            return None
        nq = nk = 1
    has_bias = any(isinstance(value(m), torch.Tensor) for m in site.mask_nodes())
    return bf16_backward.available(value(site.q).device, shape.d, shape.dv or shape.d, nq, nk, shape.causal,
                                   diagonal, window, has_bias)


def _override(site: Site, reason: str, path: str) -> Decision:
    """An override's path; the hybrid one only where a BF16 backward applies (at an
    inference site it is the fp8 path: there is no backward)."""
    if path != HYBRID:
        return Decision(path, reason)
    if not site.training():
        return Decision("fp8", reason + " (inference: the fp8 path)")
    shape = site_shape(site)
    backend = hybrid_backend(site, shape) if shape is not None else None
    if backend is None:
        return Decision("bf16", reason + ": no BF16 backward applies this site's structure exactly")
    return Decision(HYBRID, f"{reason} (bf16 backward: {backend})")


_calibrated: dict = {}


def calibrated_table(gpu_name: str) -> CostTable | None:
    """The table ``calibrate()`` measured on this GPU model under these software versions
    (``cost_tables.load_calibrated``), re-read when its file or the versions change."""
    path = cost_tables.calibrated_path(gpu_name)
    try:
        info = path.lstat()
    except OSError:
        return None
    stamp = (str(path), info.st_mtime_ns, info.st_size, info.st_ino, repr(cost_tables.versions(gpu_name)))
    if stamp not in _calibrated:
        doc = cost_tables.load_calibrated(gpu_name)
        _calibrated.clear()
        _calibrated[stamp] = None if doc is None else CostTable.from_doc(doc, calibrated=True)
    return _calibrated[stamp]


def cost_model(device: torch.device) -> "CostTable | AnalyticModel | None":
    """The table calibrated on this GPU, else the one shipped for its model, else the
    analytic model of its properties."""
    gpu = torch.cuda.get_device_name(device)
    return calibrated_table(gpu) or table_for(gpu) or AnalyticModel.of(device)


def _threshold(path: "PricedPath", model, shape: SiteShape) -> float:
    """The predicted speedup a path needs at a shape: its own margin, or the model's there
    if wider (the analytic model's fit error; a measured table has none of its own)."""
    if isinstance(model, AnalyticModel):
        return max(path.min_speedup, model.min_speedup(shape, path.rates))
    return path.min_speedup


def cost_model_decision(shape: SiteShape, path: "PricedPath | str", model: "CostTable | AnalyticModel | None",
                        gpu: str) -> Decision:
    """The cost model's choice between ``path`` (a format's name, or a ``PricedPath``) and BF16
    for one static shape."""
    path = PricedPath(path) if isinstance(path, str) else path
    if model is None:
        return Decision("bf16", f"no measured cost table for {gpu} and no properties to model it; "
                        "fp4_inductor.calibrate() measures this GPU (or run fp4_inductor.tune(), "
                        "or use policy='always')")
    speedup = model.speedup(shape, path.rates)
    if speedup is None:
        return Decision("bf16", f"{shape.table_key()} not measured on this GPU for {path.label} ({model.label} "
                        "has no rate; fp4_inductor.tune() measures it)")
    threshold = _threshold(path, model, shape)
    note = f" (its fit's error here asks for {threshold:.2f}x)" if threshold > path.min_speedup else ""
    return _verdict(path, speedup, speedup >= threshold, note, label=model.label)


def _verdict(path: "PricedPath", speedup: float, wins: bool, note: str = "", label: str = "cost model") -> Decision:
    if wins:
        return Decision(path.name, f"{label}: {path.label} {speedup:.2f}x over BF16{note}", speedup)
    return Decision("bf16", f"{label}: {path.label} would be {speedup:.2f}x of BF16{note}", speedup)


_CROSSOVER_GRID = tuple(2**i for i in range(4, 21))


def crossover_length(shape: SiteShape, path: "PricedPath | str", model: "CostTable | AnalyticModel",
                     vary: str = "both") -> int | None:
    """The smallest length (on a power-of-two grid) from which low precision is predicted
    to win at every longer length; None if never.  ``vary``: which lengths grow, the other
    staying as in ``shape``: ``"both"`` (prefill, training: queries in proportion to
    keys; the length returned is the keys'), ``"keys"`` (decode: a growing cache, fixed
    queries) or ``"queries"`` (a fixed cache, chunked or speculative queries; the length
    returned is the queries')."""
    path = PricedPath(path) if isinstance(path, str) else path
    threshold = None
    for n in reversed(_CROSSOVER_GRID):
        if vary == "queries":
            scaled = dataclasses.replace(shape, nq=n)
        else:
            nq = max(1, round(shape.nq * n / shape.nk)) if vary == "both" else shape.nq
            scaled = dataclasses.replace(shape, nk=n, nq=nq)
        speedup = model.speedup(scaled, path.rates)
        if speedup is None or speedup < _threshold(path, model, scaled):
            break
        threshold = n
    return threshold


def site_key(site: Site, fmt: str, p_mode: str | None) -> str:
    """Identity of a site in the tuning cache: everything its timing and accuracy depend
    on (shape, the masks and causal structure, training, dtype, the format and its P mode)."""
    s = site_shape(site)
    dtype = str(value(site.q).dtype).removeprefix("torch.")
    parts = (fmt, p_mode or default_p_mode(fmt), dtype, f"b{s.b}", f"h{s.h}", f"kv{s.hkv}", f"q{s.nq}", f"k{s.nk}",
             f"d{s.d}" + (f"v{s.dv}" if s.dv else ""), s.mask.replace(" ", ""), "train" if s.training else "fwd")
    return "/".join(parts)
