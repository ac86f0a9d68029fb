"""``explain()``: which attention sites a model has, which path each takes, and why."""

from __future__ import annotations

import dataclasses

import torch

from . import config
from .compiler import SiteRecord, error_summary, rewrite_and_compile
from .eager import recording
from .probe import run_once


@dataclasses.dataclass
class Report:
    """What ``explain`` found: the attention sites, how many graphs Dynamo captured, the
    reasons it broke graphs, and the error of a trace that failed."""

    sites: list[SiteRecord]
    graphs: int = 0
    graph_breaks: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    eager: bool = False  # explain(eager=True): the model ran without Dynamo

    def __str__(self) -> str:
        lines = [self._table()] if self.sites else [self._no_sites()]
        if self.graph_breaks:
            lines.append(f"{len(self.graph_breaks)} graph break(s); attention in the code between graphs runs "
                         "eagerly, not through fp4attn:")
            lines += [f"  - {reason}" for reason in self.graph_breaks]
        return "\n".join(lines)

    def _no_sites(self) -> str:
        if self.eager:
            return ("fp4attn: no attention call went through fp4_inductor's eager attention "
                    "(scaled_dot_product_attention, patch(), attn_implementation=\"fp4attn\", the diffusers processor)"
                    + (f"; the run failed: {self.error}" if self.error is not None else ""))
        if self.error is not None:
            return f"fp4attn: tracing failed, so no site could be examined: {self.error}"
        if self.graph_breaks:
            captured = (f"none of the {self.graphs} graph(s) Dynamo captured has attention in it" if self.graphs
                        else "Dynamo captured no graph")
            return f"fp4attn: {captured}: its graph breaks (below) left attention outside"
        if self.graphs == 0:
            return ("fp4attn: Dynamo captured no graph (the frame was skipped: torch.compiler.disable, "
                    "a skipped module, or nothing to trace), so no attention was seen")
        return (f"fp4attn: no attention sites found in {self.graphs} graph(s): no SDPA call, softmax(QK^T)V or "
                "nn.MultiheadAttention in them (attention inside a custom op or a C++ extension is not visible)")

    def _table(self) -> str:
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


def explain(model_or_fn, *args, policy: str | None = None, fmt: str | None = None, eager: bool = False,
            **kwargs) -> Report:
    """Compile ``model_or_fn`` with the fp4attn rewrite, run it once on ``args``/``kwargs``
    and report every attention site, the graph breaks and, if tracing fails, why (reported,
    not raised).  The rewritten graphs are traced by AOTAutograd as the backend traces them
    (a site whose trace fails is reported left to SDPA, as the backend leaves it) and run
    without Inductor, so this is quick; the decisions are the ones ``backend="fp4attn"`` makes.  Resets Dynamo's caches, as
    ``torch._dynamo.explain`` does (``probe.run_once``).

    With ``eager=True`` the model runs once as it is, without Dynamo, and the report lists
    every call of fp4_inductor's eager attention (``fp4_inductor.scaled_dot_product_attention``,
    ``patch()``, the transformers and diffusers integrations) with its path and reason."""
    if eager:
        return _explain_eager(model_or_fn, args, kwargs, policy, fmt)
    options = config.current().replace(policy=policy, fmt=fmt)
    records: list[SiteRecord] = []
    graphs = []

    def recording_backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        graphs.append(gm)
        compiled, site_records = rewrite_and_compile(gm, options, lambda g: aot_eager(g, example_inputs))
        records.extend(site_records)
        return compiled

    counters = torch._dynamo.utils.counters
    counters["graph_break"].clear()
    error = None
    try:
        run_once(model_or_fn, recording_backend, *args, **kwargs)
    except Exception as err:  # reported: explain is how a user finds out why
        error = error_summary(err)
    breaks = [_break_line(reason) for reason in counters["graph_break"]]
    return Report(records, graphs=len(graphs), graph_breaks=breaks, error=error)


def _explain_eager(model_or_fn, args, kwargs, policy, fmt) -> Report:
    names = {m: n for n, m in model_or_fn.named_modules()} if isinstance(model_or_fn, torch.nn.Module) else {}
    error = None
    with config.configure(policy=policy, fmt=fmt), recording(names) as records:
        try:
            model_or_fn(*args, **kwargs)
        except Exception as err:  # reported, as a failed trace is
            error = error_summary(err)
    return Report(records, error=error, eager=True)


def _break_line(reason: str) -> str:
    """Dynamo's reason for a graph break, its first line and, where it gives one, its hint:
    the hint is often the fix (a config flag, a function to mark)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    hints = [line for line in lines[1:] if line.startswith("Hint:")]
    return "; ".join(lines[:1] + hints[:1])
