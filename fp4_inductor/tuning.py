"""``tune()``: measure each attention site of a model on this GPU through both paths and
keep the decisions in a JSON cache that later compiles read.

The cache lives in ``$FP4ATTN_CACHE_DIR`` or ``$XDG_CACHE_HOME/fp4_inductor`` (default
``~/.cache/fp4_inductor``), one file per GPU model.  It is validated on load, written
atomically, and never pickled; a corrupt file or one written for another GPU or other
library versions is ignored with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import warnings
from pathlib import Path

import torch

from . import config
from . import quantized
from ._version import __version__
from .attention import empty_row_fill, lowp_attention
from .config import cache_dir
from .cost_tables import MAX_BYTES, read_json
from .patterns import find_sites, graph_modules, replace_site
from .probe import run_once
from .policy import MIN_MEASURED_SPEEDUP, decide, gpu_slug, hybrid_backend, prefers_hybrid, site_key, site_shape

SCHEMA = 3  # 2: keys name the dtype, an added mask and the P mode; 3: the mask kind and value head dim
_ENTRY_FIELDS = {"path": str, "speedup": float, "cosine": float, "t_low_ms": float, "t_bf16_ms": float}
_HYBRID_FIELD = "t_hybrid_ms"  # training sites where the hybrid path applies


def environment(gpu: str) -> dict:
    """What the measurements depend on besides the shape."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "fp4_inductor": __version__}


def cache_file(gpu: str) -> Path:
    return cache_dir() / f"decisions-{gpu_slug(gpu)}.json"


def _valid_entry(entry) -> bool:
    if not isinstance(entry, dict) or set(entry) - {_HYBRID_FIELD} != set(_ENTRY_FIELDS):
        return False
    for name, kind in {**_ENTRY_FIELDS, _HYBRID_FIELD: float}.items():
        if name not in entry:
            continue
        value = entry[name]
        if kind is float:
            # isinstance first: math.isfinite raises OverflowError on an integer beyond float's range
            if isinstance(value, bool) or not isinstance(value, float) and not (
                    isinstance(value, int) and abs(value) < 2**53) or not math.isfinite(value):
                return False
        elif not isinstance(value, kind):
            return False
    return entry["path"] in config.PATHS and (entry["path"] != config.HYBRID or _HYBRID_FIELD in entry)


# A cache holds one entry per attention shape of a model: a few kilobytes.  Anything far
# larger is not ours (and would cost every compile that reads it).
MAX_CACHE_BYTES = MAX_BYTES


def load_decisions(gpu: str) -> dict:
    """Tuned decisions for this GPU and library versions ({} if none or unusable: any
    content, size, encoding or kind of file is ignored with a warning, never raised)."""
    path = cache_file(gpu)
    doc = read_json(path, "tuning cache")
    if doc is None:
        return {}  # no cache yet, or unusable (warned)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("entries"), dict):
        warnings.warn(f"fp4attn: ignoring tuning cache {path}: unknown schema", RuntimeWarning, stacklevel=2)
        return {}
    if doc.get("environment") != environment(gpu):
        warnings.warn(
            f"fp4attn: ignoring tuning cache {path}: written for {doc.get('environment')}, not {environment(gpu)}",
            RuntimeWarning, stacklevel=2,
        )
        return {}
    entries = doc["entries"]
    if not all(isinstance(k, str) and _valid_entry(v) for k, v in entries.items()):
        warnings.warn(f"fp4attn: ignoring tuning cache {path}: malformed entries", RuntimeWarning, stacklevel=2)
        return {}
    return entries


def save_decisions(gpu: str, entries: dict) -> Path:
    """Merge ``entries`` into the cache file, atomically (write a temporary, then rename)."""
    merged = {**load_decisions(gpu), **entries}
    path = cache_file(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "environment": environment(gpu), "entries": merged}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


@dataclasses.dataclass
class TuneResult:
    """One site ``tune()`` measured: its cache ``key`` (``policy.site_key``), its module
    path ``name``, and the stored ``entry`` (``path``, ``speedup``, ``cosine``,
    ``t_low_ms``, ``t_bf16_ms`` and at hybrid sites ``t_hybrid_ms``; empty if the site
    never ran)."""

    key: str
    name: str
    entry: dict


def _gpu_name() -> str:
    if not torch.cuda.is_available():
        raise RuntimeError("fp4_inductor.tune() measures on a CUDA GPU; none is available")
    return torch.cuda.get_device_name()


def _median_ms(fn, rep_ms: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def _probe(q, k, v, attn_mask=None, scale=None, is_causal=False, *, fmt, p_mode, key, results, min_cosine, rep_ms,
           hybrid=False, empty_rows="zero", **structure):
    """Runs in place of a site while tuning: BF16 SDPA (what the site falls back to) and
    the low-precision path on the real activations (with ``hybrid``, a training site's
    hybrid path too: the same forward, so the same output); records times and accuracy,
    returns the BF16 output so the model runs on unchanged.  ``structure``: the causal
    structure and key padding ``lowp_attention`` takes."""
    training = q.requires_grad
    q, k, v = (t.detach().requires_grad_(training) for t in (q, k, v))

    def bf16():
        out, empty = quantized.sdpa_with_structure(q, k, v, attn_mask, scale, is_causal, **structure)
        out = empty_row_fill(out, empty, v, empty_rows, attn_mask)
        if training:
            out.backward(torch.ones_like(out))
        return out

    def low(backward="lowp"):
        out = lowp_attention(q, k, v, attn_mask, scale, is_causal, fmt=fmt, p_mode=p_mode, empty_rows=empty_rows,
                             backward=backward, **structure)
        if training:
            out.backward(torch.ones_like(out))
        return out

    with torch.enable_grad():
        ref, got = bf16(), low()
        cosine = torch.nn.functional.cosine_similarity(got.double().flatten(), ref.double().flatten(), dim=0).item()
        t_bf16, t_low = _median_ms(bf16, rep_ms), _median_ms(low, rep_ms)
        entry = {"path": fmt, "speedup": t_bf16 / t_low, "cosine": cosine, "t_low_ms": t_low, "t_bf16_ms": t_bf16}
        if hybrid:
            entry[_HYBRID_FIELD] = _median_ms(lambda: low("bf16"), rep_ms)
    fast = entry["speedup"] >= MIN_MEASURED_SPEEDUP
    hybrid_speedup = t_bf16 / entry[_HYBRID_FIELD] if hybrid else 0.0
    if cosine < min_cosine:
        entry["path"] = "bf16"
    elif hybrid_speedup >= MIN_MEASURED_SPEEDUP and (not fast or prefers_hybrid(hybrid_speedup, entry["speedup"])):
        entry.update(path=config.HYBRID, speedup=hybrid_speedup)
    elif not fast:
        entry["path"] = "bf16"
    results[key] = entry
    return ref.detach()


def tune(model_or_fn, *args, fmt: str | None = None, min_cosine: float | None = None, rep_ms: int = 100,
         **kwargs) -> list[TuneResult]:
    """Time every supported attention site of ``model_or_fn(*args, **kwargs)`` on this GPU
    in BF16 and in low precision (at training sites the hybrid path too, where a BF16
    backward applies), keep low precision where it is faster and at least
    ``min_cosine`` accurate (cosine of the site's output vs BF16 on the real activations),
    and store the decisions for later compiles (``policy="auto"``).  Resets Dynamo's
    caches (``run_once``)."""
    gpu = _gpu_name()
    options = config.current().replace(fmt=fmt, min_cosine=min_cosine, policy="always")
    measured: dict = {}
    results: list[TuneResult] = []

    def probe_for(key: str, hybrid: bool):
        # A closure, not graph arguments: FX copies dict arguments when it builds a node,
        # so results written through one would land in the copy.
        def probe(q, k, v, attn_mask=None, scale=None, is_causal=False, *, fmt, p_mode, **structure):
            return _probe(q, k, v, attn_mask, scale, is_causal, fmt=fmt, p_mode=p_mode, key=key,
                          results=measured, min_cosine=options.min_cosine, rep_ms=rep_ms, hybrid=hybrid,
                          **structure)

        return probe

    def probing_backend(gm, example_inputs):
        for module in graph_modules(gm):
            for site in find_sites(module.graph):
                if not decide(site, options).low_precision:
                    continue
                p_mode = options.p_mode_for(options.fmt)
                key = site_key(site, options.fmt, p_mode)
                results.append(TuneResult(key, site.name, {}))
                hybrid = (site.training() and options.fmt == "fp8"
                          and hybrid_backend(site, site_shape(site)) is not None)
                replace_site(module.graph, site, options.fmt, p_mode, attention=probe_for(key, hybrid))
            module.recompile()
        return gm.forward

    run_once(model_or_fn, probing_backend, *args, **kwargs)
    save_decisions(gpu, measured)
    for result in results:
        result.entry = measured.get(result.key, {})
    return results
