"""``flex_attention`` calls: the higher-order op in the Dynamo graph.

Dynamo turns ``flex_attention(q, k, v, score_mod, block_mask=...)`` (called directly or
through a ``torch.compile``'d wrapper, which tracing inlines) into
``torch.ops.higher_order.flex_attention(q, k, v, score_mod_graph, block_mask_tuple,
scale, kernel_options, score_mod_buffers, mask_mod_buffers)``, with the mask_mod as the
block-mask tuple's last element: a graph of ``(b, h, q_idx, kv_idx, *mask_mod_buffers)``.
A site runs our ops where the score_mod is the identity (None, as flex passes it) and
``masks.mask_structure`` reads the mask_mod whole (causal, sliding windows, documents,
their ``and_masks``); the block mask is taken to be what ``create_block_mask`` builds
from that mask_mod (its full blocks the mask_mod's all-True ones).  Any other site stays
flex, with the reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .common import Site, module_path, value
from .mask_values import Index
from .masks import LIFTED, mask_structure
from .packed import Source

FLEX = getattr(torch.ops.higher_order, "flex_attention", None)


def match_flex(node: fx.Node) -> Site | None:
    if FLEX is None or node.op != "call_function" or node.target is not FLEX:
        return None
    users = list(node.users)
    outputs = [u for u in users if u.target is operator.getitem and u.args[1] == 0]
    q, k, v, score_mod, block_mask, scale = node.args[:6]
    mask_buffers = node.args[8] if len(node.args) > 8 else ()
    site = Site("flex", outputs[0] if len(outputs) == 1 else node, q=q, k=k, v=v, scale=scale,
                name=module_path(node))
    if len(outputs) != 1 or len(users) != 1:
        site.unsupported = "flex_attention's log-sum-exp is used (the low-precision op returns the output only)"
    elif not _identity_score_mod(node, score_mod):
        site.unsupported = "flex_attention with a score_mod (only None or the identity run in low precision)"
    elif not isinstance(scale, (int, float)):
        site.unsupported = "flex_attention with a scale that is not a constant"
    elif not _lengths_match(block_mask, q, k):
        site.unsupported = "flex_attention's block mask is for other sequence lengths"
    else:
        structure = _mask_mod_structure(node, block_mask[-1], mask_buffers)
        if structure is None:
            site.unsupported = ("flex_attention mask_mod not read as causal, sliding-window, document or key-padding "
                                "structure (or their and_masks)")
            site.mask_note = "mask_mod"
        else:
            site.structure, site.causal = structure, structure.causal
    return site


def _submodule(node: fx.Node, attr) -> fx.GraphModule | None:
    if not (isinstance(attr, fx.Node) and attr.op == "get_attr"):
        return None
    module = node.graph.owning_module
    found = getattr(module, attr.target, None) if module is not None else None
    return found if isinstance(found, fx.GraphModule) else None


def _identity_score_mod(node: fx.Node, score_mod) -> bool:
    """Whether the score_mod graph returns its score (flex's default for None) untouched."""
    graph = _submodule(node, score_mod)
    if graph is None:
        return False
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return bool(placeholders) and result is placeholders[0]


def _lengths_match(block_mask, q, k) -> bool:
    """The block mask's (Q_LEN, KV_LEN), its first two elements, are the call's."""
    if not isinstance(block_mask, (tuple, list)) or len(block_mask) < 3:
        return False
    nq, nk = value(q).shape[-2], value(k).shape[-2]
    return all(isinstance(n, (int, torch.SymInt)) and n == want for n, want in zip(block_mask[:2], (nq, nk)))


def _mask_mod_structure(node: fx.Node, mask_mod, buffers):
    """The mask_mod's structure, its scalar arguments read as the batch, row and column
    indices and its buffers as the calling graph's tensors; None where not recognised."""
    graph = _submodule(node, mask_mod)
    if graph is None:
        return None
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 4 + len(buffers):
        return None
    b, _, q_idx, kv_idx, *inner = placeholders  # the head index is not read: a use of it is not recognised
    for placeholder, meaning in zip((b, q_idx, kv_idx, *inner),
                                    (Index(-4), Index(-2), Index(-1), *(Source(x) for x in buffers))):
        placeholder.meta[LIFTED] = meaning
    output = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    output = output[0] if isinstance(output, (tuple, list)) and len(output) == 1 else output
    found = mask_structure(output)
    for placeholder in placeholders:
        placeholder.meta.pop(LIFTED, None)
    if found is None:
        return None
    found.nodes = ()  # the mask_mod's nodes belong to its own graph
    return found
