"""User-facing options: ``configure()`` and the FP4ATTN_* environment variables.

Options are read when a graph is compiled; a function already compiled keeps the
decisions it was compiled with (call ``torch._dynamo.reset()`` to recompile).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .formats import FORMATS

POLICIES = ("auto", "always", "never")
# The training path of our FP8 forward with a BF16 FlashAttention-class backward
# (``attention.lowp_attention(backward="bf16")``); at an inference site it is the fp8 path.
HYBRID = "fp8+bf16bwd"
PATHS = (*FORMATS, HYBRID, "bf16")
FP8_P_MODES = ("direct", "exp")  # fp4's P has its own classifier (formats)


def path_arguments(path: str) -> dict:
    """``lowp_attention``'s ``fmt`` and ``backward`` for a low-precision path: the hybrid is
    the fp8 forward with the BF16 backward."""
    return {"fmt": "fp8", "backward": "bf16"} if path == HYBRID else {"fmt": path}


@dataclasses.dataclass(frozen=True)
class Options:
    policy: str = "auto"
    fmt: str = "fp8"
    # Advanced: the P operand mode for fmt="fp8" ("direct" or "exp"); None = format default.
    p_mode: str | None = None
    # Per-site overrides, first match wins: ((glob on the site's module path, path), ...),
    # e.g. (("model.layers.0.*", "bf16"),) keeps the first layer in BF16; HYBRID gives a
    # training site the FP8 forward with a BF16 backward.
    overrides: tuple = ()
    # tune(): keep low precision at a site only if its output cosine vs BF16 is at least this.
    min_cosine: float = 0.99

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.p_mode is not None and self.p_mode not in FP8_P_MODES:
            raise ValueError(f"p_mode must be one of {FP8_P_MODES}, got {self.p_mode!r}")
        for pattern, path in self.overrides:
            if not isinstance(pattern, str) or path not in PATHS:
                raise ValueError(f"override ({pattern!r}, {path!r}): need (glob, one of {PATHS})")
        if not 0.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine must lie in [0, 1], got {self.min_cosine}")

    def p_mode_for(self, path: str) -> str | None:
        """The P mode a site taking ``path`` runs: ``p_mode`` is fp8's option; fp4 has its own."""
        return self.p_mode if path in ("fp8", HYBRID) else None

    def replace(self, **changes) -> "Options":
        if isinstance(changes.get("overrides"), dict):
            changes["overrides"] = tuple(changes["overrides"].items())
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


_ENV = {"policy": "FP4ATTN_POLICY", "fmt": "FP4ATTN_FORMAT"}


def cache_dir() -> Path:
    """Where what is measured on this machine is kept (``tune()``'s decisions,
    ``calibrate()``'s cost table): ``$FP4ATTN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/fp4_inductor`` (default ``~/.cache/fp4_inductor``)."""
    if os.environ.get("FP4ATTN_CACHE_DIR"):
        return Path(os.environ["FP4ATTN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp4_inductor"


def _from_env() -> Options:
    """The defaults with the FP4ATTN_* variables applied; an unset or empty one keeps its default."""
    opts = Options()
    for field, var in _ENV.items():
        raw = os.environ.get(var, "").strip().lower()
        if raw:
            try:
                opts = opts.replace(**{field: raw})
            except ValueError as err:
                raise ValueError(f"environment variable {var}: {err}") from None
    return opts


_overrides: list[dict] = []


def current() -> Options:
    """Environment defaults with every active ``configure()`` applied in order."""
    opts = _from_env()
    for changes in _overrides:
        opts = opts.replace(**changes)
    return opts


class configure:
    """Set options for later compiles: ``fp4_inductor.configure(policy="always")``
    applies until changed; ``with fp4_inductor.configure(fmt="fp4"): ...`` only inside.

    ``overrides`` maps globs on module paths (as ``explain`` prints them) to a path:
    ``{"model.layers.0.*": "bf16", "model.layers.31.*": "bf16"}``.
    """

    def __init__(
        self,
        policy: str | None = None,
        fmt: str | None = None,
        p_mode: str | None = None,
        overrides: dict | None = None,
        min_cosine: float | None = None,
    ):
        changes = {
            "policy": policy,
            "fmt": fmt,
            "p_mode": p_mode,
            "overrides": overrides,
            "min_cosine": min_cosine,
        }
        current().replace(**changes)  # validate now, not at the next compile
        self._changes = changes
        _overrides.append(changes)

    def __enter__(self) -> "configure":
        if not any(c is self._changes for c in _overrides):  # a configure object used again
            _overrides.append(self._changes)
        return self

    def __exit__(self, *exc) -> None:
        _overrides[:] = [c for c in _overrides if c is not self._changes]
