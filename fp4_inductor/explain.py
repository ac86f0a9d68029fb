"""``explain()``: which attention sites a model has, which path each takes, and why."""

from __future__ import annotations

import dataclasses

from . import config
from .compiler import SiteRecord, rewrite
from .tuning import run_once


@dataclasses.dataclass
class Report:
    sites: list[SiteRecord]

    def __str__(self) -> str:
        if not self.sites:
            return "fp4attn: no attention sites found"
        header = ("#", "site", "kind", "B,H,Hkv,Nq,Nkv,D", "mask", "train", "path", "speedup", "reason")
        rows = [
            (
                str(i),
                s.name or "-",
                s.kind,
                ",".join(map(str, s.shape)) if s.shape else "?",
                s.mask,
                "yes" if s.training else "no",
                s.path,
                f"{s.predicted_speedup:.2f}x" if s.predicted_speedup is not None else "-",
                s.reason,
            )
            for i, s in enumerate(self.sites)
        ]
        widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def explain(model_or_fn, *args, policy: str | None = None, fmt: str | None = None, **kwargs) -> Report:
    """Compile ``model_or_fn`` with the fp4attn rewrite, run it once on ``args``/``kwargs``
    and report every attention site.  The rewritten graphs run eagerly (no Inductor
    compile), so this is quick; the decisions are the ones ``backend="fp4attn"`` makes.
    Resets Dynamo's caches, as ``torch._dynamo.explain`` does (``tuning.run_once``)."""
    options = config.current().replace(policy=policy, fmt=fmt)
    records: list[SiteRecord] = []

    def recording_backend(gm, example_inputs):
        records.extend(rewrite(gm, options))
        return gm.forward

    run_once(model_or_fn, recording_backend, *args, **kwargs)
    return Report(records)
