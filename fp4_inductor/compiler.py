"""The ``fp4attn`` torch.compile backend: rewrite attention sites, then Inductor.

``torch.compile(model, backend="fp4attn")`` finds ``fp4attn`` through the package's
``torch_dynamo_backends`` entry point and calls :func:`fp4attn` with the options of
``configure()`` / FP4ATTN_*; :func:`backend` gives a backend with options of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import config
from .config import Options
from .runtime import causal_sdpa
from .patterns import find_sites, graph_modules, reads_causal_mask, replace_site
from .patterns.common import value
from .patterns.masks import drop_unread_masks
from .patterns.softmax import softmax_over_other_dim
from .policy import Decision, decide
from .tuning import load_decisions


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """One attention site as ``explain()`` reports it."""

    name: str
    kind: str
    shape: tuple | None
    causal: bool
    mask: str  # Site.mask_kind(): "none", "causal", "causal+padding", "window 4096", "dense", ...
    training: bool
    path: str
    reason: str
    predicted_speedup: float | None
    rewritten: bool = False  # the pass replaced the site (low precision, or SDPA's is_causal)


class AttentionRewritePass:
    """Rewrites the attention sites of a Dynamo graph in place and records each decision.
    It runs before AOTAutograd, so the graph Inductor compiles and caches already holds
    its decisions; the ops' implementations are looked up at run time."""

    def __init__(self, options: Options):
        self.options = options
        self.records: list[SiteRecord] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        tuned = None
        for site in find_sites(graph):
            if tuned is None:
                tuned = _tuned_decisions(site) if self.options.policy == "auto" else {}
            decision = decide(site, self.options, tuned)
            rewritten = True
            if decision.low_precision:
                replace_site(graph, site, decision.path, self.options.p_mode_for(decision.path),
                             min_keys=decision.min_keys)
            elif self.options.policy != "never" and not decision.unsupported and reads_causal_mask(site):
                replace_site(graph, site, "bf16", None, attention=causal_sdpa)
                decision = dataclasses.replace(decision, reason=decision.reason + "; causal mask run as is_causal")
            else:
                rewritten = False
            self.records.append(_record(site, decision, rewritten))


def _tuned_decisions(site) -> dict:
    q = value(site.q)
    if not isinstance(q, torch.Tensor) or q.device.type != "cuda":
        return {}
    return load_decisions(torch.cuda.get_device_name(q.device))


def _record(site, decision: Decision, rewritten: bool) -> SiteRecord:
    return SiteRecord(
        name=site.name,
        kind=site.kind,
        shape=site.shape(),
        causal=site.causal,
        mask=site.mask_kind(),
        training=site.training(),
        path=decision.path,
        reason=decision.reason,
        predicted_speedup=decision.predicted_speedup,
        rewritten=rewritten,
    )


def rewrite(gm: torch.fx.GraphModule, options: Options) -> list[SiteRecord]:
    """Rewrite ``gm`` and the graphs nested in it (``graph_modules``)."""
    rewrite_pass = AttentionRewritePass(options)
    modules = graph_modules(gm)
    for module in modules:
        rewrite_pass(module.graph)
    for module in reversed(modules):  # bodies first: what they no longer read
        drop_unread_masks(module)
        module.graph.lint()
        module.recompile()
    return rewrite_pass.records


log = logging.getLogger(__name__)


def rewrite_and_compile(gm: torch.fx.GraphModule, options: Options, compile_fn) -> tuple[object, list[SiteRecord]]:
    """``compile_fn(gm)`` on the rewritten graph.  Should that fail, the graph's sites are
    left to SDPA as the model wrote them, the rest is compiled all the same, and the log
    (every time) and the records (``explain``) say why: a backend that raises sends the
    whole frame to eager, or fails it under ``fullgraph``."""
    original = [(module, _copy_graph(module.graph)) for module in gm.modules() if isinstance(module, torch.fx.GraphModule)]
    records = rewrite(gm, options)
    try:
        return compile_fn(gm), records
    except (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame):
        raise  # Dynamo's own control flow (a restart with other specialisations), not a failure
    except Exception as err:
        if not any(r.rewritten for r in records):
            raise  # the graph as the model wrote it: not ours to leave
        summary = error_summary(err)  # our ops' trace failed: the sites go back to SDPA
        for module, graph in original:
            module.graph = graph
            module.recompile()
        names = [r.name or r.kind for r in records if r.rewritten]
        log.warning("fp4attn: %d attention site(s) left to SDPA (%s): compiling them with fp4attn's ops failed: %s",
                    len(names), ", ".join(names), summary)
        reason = f"left to SDPA: compiling this graph with fp4attn's ops failed ({summary})"
        records = [dataclasses.replace(r, path="bf16", reason=reason, predicted_speedup=None, rewritten=False)
                   if r.rewritten else r for r in records]
        return compile_fn(gm), records


def error_summary(err: Exception) -> str:
    """The first line of an error and, for Dynamo's, the line that explains it."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    picked = lines[:1] + [line for line in lines[1:] if line.startswith("Explanation:")][:1]
    return f"{type(err).__name__}: {' '.join(picked)}"[:600]


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``'s nodes (their meta shared, not copied) that keeps the attributes
    Dynamo sets on nodes (a placeholder's ``_dynamo_source``, which AOTAutograd reads)."""
    node_map = {None: None}  # Graph.__deepcopy__ fills a memo it is given only if it is non-empty
    copied = copy.deepcopy(graph, node_map)
    for old, new in node_map.items():
        if isinstance(old, torch.fx.Node) and isinstance(new, torch.fx.Node):
            for name, attribute in vars(old).items():
                if name not in vars(new):
                    setattr(new, name, attribute)
    return copied


class SourceIdentity(CustomGraphPass):
    """A post-grad pass that changes nothing but keys Inductor's FX graph cache on this
    package's sources (``uuid``): a graph cached under another version of our ops' fake
    kernels (their output shapes) would fail its size asserts at run time.  A user's own
    pass of that slot runs inside it and joins the key."""

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self):
        inner = None
        if self.inner is not None:
            inner = self.inner.uuid() if hasattr(self.inner, "uuid") else None
            if inner is None:
                return None  # a pass without an identity: Inductor does not cache
        return (_package_hash(), inner)


@functools.cache
def _package_hash() -> bytes:
    root = Path(__file__).parent
    return get_hash_for_files(tuple(sorted(str(p) for p in (*root.rglob("*.py"), *root.glob("tables/*.json")))))


def compile_graph(gm: torch.fx.GraphModule, example_inputs, options: Options, mode: str | None = None,
                  inductor_options: dict | None = None):
    """Rewrite, then Inductor with ``torch.compile``'s ``mode``/``options`` applied as
    Inductor does for itself (``mode="reduce-overhead"`` means CUDA graphs)."""
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    patches = {**(torch._inductor.list_mode_options(mode) if mode else {}), **(inductor_options or {})}
    inner = patches.get("post_grad_custom_pre_pass", torch._inductor.config.post_grad_custom_pre_pass)
    patches["post_grad_custom_pre_pass"] = inner if isinstance(inner, SourceIdentity) else SourceIdentity(inner)

    def inductor(graph_module):
        graph_patches = dict(patches)
        if softmax_over_other_dim(graph_module.graph):
            # Inductor's attention fusion takes softmax(S, dim=-2) @ V for attention and
            # computes it wrongly (rel-L2 0.19 against eager in torch 2.13): its pattern
            # matcher stays off for this graph.
            graph_patches["pattern_matcher"] = False
        return compile_fx(graph_module, example_inputs, config_patches=graph_patches)

    return rewrite_and_compile(gm, options, inductor)[0]


def fp4attn(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """The registered backend: options from ``configure()`` and FP4ATTN_* at compile time;
    ``torch.compile``'s ``mode`` and ``options`` go to Inductor."""
    return compile_graph(gm, example_inputs, config.current(), mode, options)


class backend:
    """A backend with its own options: ``torch.compile(m, backend=fp4_inductor.backend(fmt="fp4"))``."""

    def __init__(self, policy: str | None = None, fmt: str | None = None, **options):
        self.options = config.current().replace(policy=policy, fmt=fmt, **options)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
        return compile_graph(gm, example_inputs, self.options, mode, options)

    def __repr__(self) -> str:
        return f"fp4_inductor.backend({self.options})"
