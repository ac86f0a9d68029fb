"""Where the policy's cost tables come from, and what a valid one holds.

Two sources, one format (``policy.CostTable``, as ``tables/nvidia_h200.json``):

- shipped: ``tables/<gpu>.json`` in the package, measured by the project
  (``benchmarks/cost_table.py``, which runs ``calibrate()``);
- calibrated: ``<cache dir>/cost-table-<gpu>.json``, written by ``fp4_inductor.calibrate()``
  on the user's GPU.  The file wraps the table with the software it was measured with
  (``versions``): a table measured under other versions of torch, Triton, CUDA or this
  package is stale and ignored with a warning, as is a file that is not a regular file,
  too large, not JSON or not a valid table.  Never pickled; written atomically.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import tempfile
import warnings
from pathlib import Path

import torch

from ._version import __version__
from .config import cache_dir

SHIPPED = Path(__file__).parent / "tables"
SCHEMA = 1
# A table holds a few hundred rates: a few tens of kilobytes.  Anything far larger is not ours.
MAX_BYTES = 1 << 20
# A table's row key (policy.SiteShape.table_key) and path name (config.PATHS, "-kernel"
# rows, the hybrid path by its BF16 backward).
_KEY = re.compile(r"d\d+(v\d+)?/(causal|full)/(fwd|train)(/[a-z0-9+]+)?")
_PATH = re.compile(r"[a-z0-9+]+(-kernel)?(:[a-z0-9]+)?")


def gpu_slug(gpu_name: str) -> str:
    """A GPU model's name as a file-name part: ``NVIDIA H200`` -> ``nvidia_h200``."""
    return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_")


def shipped_path(gpu: str) -> Path:
    return SHIPPED / f"{gpu_slug(gpu)}.json"


def calibrated_path(gpu: str) -> Path:
    return cache_dir() / f"cost-table-{gpu_slug(gpu)}.json"


def versions(gpu: str) -> dict:
    """What a calibrated table's rates depend on besides the GPU model: its key."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "fp4_inductor": __version__}


def _number(x) -> bool:
    # isinstance first: math.isfinite raises OverflowError on an integer beyond float's range
    return not isinstance(x, bool) and isinstance(x, (int, float)) and abs(x) < 2**53 and math.isfinite(x)


def check_table(doc) -> None:
    """Raise ValueError saying what is wrong unless ``doc`` is a cost table as
    ``policy.CostTable`` reads it: ``gpu``, ``launch_us``, ``tflops[path][key][N]`` (positive
    TFLOP/s at integer lengths), optionally ``source``."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    missing = {"gpu", "launch_us", "tflops"} - set(doc)
    if missing:
        raise ValueError(f"missing {sorted(missing)}")
    if not isinstance(doc["gpu"], str) or not doc["gpu"]:
        raise ValueError("gpu is not a name")
    if not isinstance(doc.get("source", ""), str):
        raise ValueError("source is not a string")
    if not _number(doc["launch_us"]) or doc["launch_us"] < 0:
        raise ValueError(f"launch_us {doc['launch_us']!r} is not a non-negative number")
    if not isinstance(doc["tflops"], dict):
        raise ValueError("tflops is not an object")
    for path, by_key in doc["tflops"].items():
        if not _PATH.fullmatch(path) or not isinstance(by_key, dict):
            raise ValueError(f"path {path!r} is malformed")
        for key, points in by_key.items():
            if not _KEY.fullmatch(key) or not isinstance(points, dict) or not points:
                raise ValueError(f"{path}: key {key!r} is malformed")
            for n, rate in points.items():
                if not (isinstance(n, str) and n.isdigit() and 0 < int(n) < 2**31):
                    raise ValueError(f"{path} {key}: length {n!r} is not a positive integer")
                if not _number(rate) or not 0 < rate < 1e5:
                    raise ValueError(f"{path} {key} {n}: rate {rate!r} is not a TFLOP/s")


def read_json(path: Path, what: str):
    """The JSON in ``path``, or None where there is none (silently) or it is unusable: a file
    that is not regular (a symlink, a directory), over ``MAX_BYTES``, unreadable or not
    JSON is ignored with a warning naming ``what`` it was, never raised."""
    try:
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
        why = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"over {MAX_BYTES} bytes"
        warnings.warn(f"fp4attn: ignoring {what} {path}: {why}", RuntimeWarning, stacklevel=3)
        return None
    try:
        return json.loads(path.read_bytes()[:MAX_BYTES + 1].decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON or UTF-8, a huge integer
        warnings.warn(f"fp4attn: ignoring unreadable {what} {path}: {err!r}"[:500], RuntimeWarning, stacklevel=3)
        return None


def load_calibrated(gpu: str) -> dict | None:
    """The table ``calibrate()`` measured on this GPU model under these software versions,
    or None (a missing file silently; a stale, foreign or malformed one with a warning)."""
    path = calibrated_path(gpu)
    doc = read_json(path, "calibrated cost table")
    if doc is None:
        return None
    problem = None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or "table" not in doc:
        problem = "unknown schema"
    elif doc.get("environment") != versions(gpu):
        problem = (f"measured under {doc.get('environment')}, not {versions(gpu)}; "
                   "fp4_inductor.calibrate() measures it again")
    else:
        try:
            check_table(doc["table"])
            if doc["table"]["gpu"] != gpu:
                problem = f"measured on {doc['table']['gpu']}, not {gpu}"
        except ValueError as err:
            problem = f"not a cost table ({err})"
    if problem:
        warnings.warn(f"fp4attn: ignoring calibrated cost table {path}: {problem}"[:800], RuntimeWarning,
                      stacklevel=2)
        return None
    return doc["table"]


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def table_text(table: dict) -> str:
    """A table as the shipped files hold it."""
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def save_calibrated(table: dict) -> Path:
    """Store ``table`` (checked first) as this GPU's calibrated table, keyed by the versions now."""
    check_table(table)
    path = calibrated_path(table["gpu"])
    doc = {"schema": SCHEMA, "environment": versions(table["gpu"]), "table": table}
    _write_atomically(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def write_table(table: dict, directory: Path) -> Path:
    """Write ``table`` (checked first) as ``directory/<gpu>.json``, the name the policy looks up
    in ``tables/``."""
    check_table(table)
    path = Path(directory) / shipped_path(table["gpu"]).name
    _write_atomically(path, table_text(table))
    return path
