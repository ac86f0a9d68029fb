"""Find attention sites in a Dynamo graph and rewrite the chosen ones.

The rewrite happens on the torch-level graph, before AOTAutograd: the replacement is a
call of ``attention.lowp_attention``, which AOTAutograd traces into the ``fp4attn``
ops (quantize, fwd) and whose autograd gives training the FP8 backward.  Matchers start
at SDPA and softmax nodes and walk producers, so symbolic shapes do not stop them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..attention import lowp_attention
from ..runtime import combine_masks
from ..config import path_arguments
from .common import Site, node_kind, value
from .masks import erase_dead, lift_mask_structures, materialize
from .packed import document_kwargs
from .encoder import match_fast_path
from .flex import match_flex
from .mha import match_mha
from .sdpa import match_sdpa, match_sdpa_backend
from .softmax import match_softmax

MATCHERS = (match_sdpa, match_sdpa_backend, match_softmax, match_mha, match_fast_path, match_flex)


def graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the graphs of the higher-order ops it calls (activation checkpointing's
    bodies, ``torch.cond`` branches, ...), which Dynamo keeps as submodules: attention
    inside them is rewritten there, and recomputing a checkpointed body reruns the same
    deterministic quantization.  Callers come before their bodies, and the masks a caller
    passes into a checkpointed body are tagged with their structure there
    (``masks.lift_mask_structures``)."""
    modules = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
    for module in modules:
        lift_mask_structures(module)
    return modules


def find_sites(graph: fx.Graph) -> list[Site]:
    sites = []
    for node in list(graph.nodes):
        for matcher in MATCHERS:
            site = matcher(node)
            if site is not None:
                sites.append(site)
                break
    return sites


def reads_causal_mask(site: Site) -> bool:
    """Whether the site's masks are SDPA's own causal structure and nothing else (a dense
    causal mask, as HF models build under tracing): its BF16 path can then be SDPA's
    ``is_causal`` (``runtime.causal_sdpa``) instead of a mask read per score.  (A
    flex_attention site reads no mask tensor: it stays flex.)"""
    return site.kind != "flex" and site.structure is not None and site.mask_kind() == "causal"


def _scale_arg(graph: fx.Graph, scale):
    """A site's softmax scale as a float or a node: SDPA's value as given, or the product
    of a hand-written site's factors (1.0 when Q came pre-scaled)."""
    if not isinstance(scale, tuple):
        return scale
    result = 1.0
    for factor, is_div in scale:
        if isinstance(result, float) and isinstance(factor, (int, float)):
            result = result / factor if is_div else result * factor
        else:
            result = graph.call_function(operator.truediv if is_div else operator.mul, (result, factor))
    return result


def replace_site(graph: fx.Graph, site: Site, path: str, p_mode: str | None, attention=lowp_attention,
                 min_keys: int | None = None) -> fx.Node:
    """Replace the site by its low-precision computation for ``path`` (``config.PATHS``: a
    format, or the hybrid training path), its attention by ``attention`` (``lowp_attention``
    or a function of its signature: ``causal_sdpa``, tuning's probe)."""
    options = {**path_arguments(path), "p_mode": p_mode}
    if min_keys is not None:
        options["min_keys"] = min_keys
    anchor = site.anchor
    with graph.inserting_before(anchor):
        new = (site.rewrite or attention_call)(graph, site, attention, options)
    new.meta.update(anchor.meta)
    anchor.replace_all_uses_with(new)
    erase_replaced(anchor)
    if site.structure is not None:
        erase_dead(site.structure.nodes)  # the mask's producers: no N x N tensor is built
    return new


def attention_call(graph: fx.Graph, site: Site, attention, options: dict) -> fx.Node:
    """``attention(q, k, v, ...)`` with the site's masks, scale and structure, cast back to
    the dtype the site returned."""
    keep_masks, drop_masks = tuple(m for m, _ in site.keep_masks), tuple(m for m, _ in site.drop_masks)
    if (len(site.bias_terms) == 1 and not site.bias_terms[0][1] and not (keep_masks or drop_masks)
            and value(site.bias_terms[0][0]).dtype != torch.bool):
        # One unscaled additive mask: pass it as SDPA would (a boolean one adds 1 where
        # True, which SDPA would read as "keep": it goes through combine_masks).
        mask = site.bias_terms[0][0]
    elif site.bias_terms or keep_masks or drop_masks:
        mask = graph.call_function(
            combine_masks,
            (site.attn_mask, tuple((m, _scale_arg(graph, f)) for m, f in site.bias_terms), keep_masks, drop_masks),
        )
    else:
        mask = site.attn_mask
    kwargs = {"attn_mask": mask, "scale": _scale_arg(graph, site.scale), "is_causal": site.causal,
              "fmt": options["fmt"], "p_mode": options["p_mode"], **_structure_kwargs(graph, site), **options}
    new = graph.call_function(attention, (site.q, site.k, site.v), kwargs)
    want = value(site.anchor).dtype
    return new if value(site.q).dtype == want else graph.call_method("to", (new, want))


def _structure_kwargs(graph: fx.Graph, site: Site) -> dict:
    """The causal structure, key padding and documents ``masks.structure_site`` read, as
    arguments."""
    s = site.structure
    if s is None:
        return {"empty_rows": site.empty_rows} if site.empty_rows != "zero" else {}
    kwargs = {"diagonal": materialize(graph, s.diagonal), "window": s.window, "empty_rows": site.empty_rows}
    if s.key_padding is not None:
        pad = s.key_padding
        if s.pad_offset != (0, ()) or value(pad).shape[-1] != value(site.k).shape[-2]:
            start = materialize(graph, s.pad_offset)
            stop = graph.call_function(operator.add, (start, graph.call_method("size", (site.k, -2))))
            pad = graph.call_function(operator.getitem, (pad, (slice(None), slice(start, stop))))
        kwargs["key_padding"] = pad
    kwargs.update(document_kwargs(graph, s, site.q, site.k, materialize))
    return kwargs


def erase_replaced(anchor: fx.Node) -> None:
    """Erase a replaced anchor and the chain that only fed it.  Unlike a general DCE this
    stops at any node it does not recognise, so nothing with unknown effects goes."""
    inputs = anchor.all_input_nodes
    anchor.graph.erase_node(anchor)
    for a in inputs:
        _erase_unused(a)


def _erase_unused(node: fx.Node) -> None:
    if node.users or node.op not in ("call_function", "call_method") or node_kind(node) is None:
        return
    inputs = node.all_input_nodes
    node.graph.erase_node(node)
    for a in inputs:
        _erase_unused(a)
