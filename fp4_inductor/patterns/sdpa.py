"""``torch.nn.functional.scaled_dot_product_attention`` calls in the Dynamo graph."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .common import SDPA_BACKENDS, Site, arg, node_kind, module_path, strip_repeat_kv, value
from .masks import structure_site


def match_sdpa(node: fx.Node) -> Site | None:
    if node_kind(node) != "sdpa":
        return None
    q, k, v = (arg(node, i) for i in range(3))
    site = Site("sdpa", node, q=q, k=k, v=v, name=module_path(node))
    site.attn_mask = arg(node, 3)
    site.scale = arg(node, 6)
    causal = arg(node, 5, default=False)
    dropout = arg(node, 4, default=0.0)
    gqa = arg(node, 7, default=False)
    if not isinstance(causal, bool):
        site.unsupported = "is_causal is not a constant"
    elif not isinstance(dropout, (int, float)) or dropout != 0:
        site.unsupported = "dropout_p > 0 (dropout is not implemented in low precision)"
    elif site.attn_mask is not None and causal:
        site.unsupported = "attn_mask together with is_causal"
    elif not gqa and _heads(q) != _heads(k):
        site.unsupported = "query and key head counts differ without enable_gqa"
    elif (reason := _mask_reason(site.attn_mask, q)) is not None:
        site.unsupported = reason
    site.causal = bool(causal) if isinstance(causal, bool) else False
    if site.unsupported is None:
        strip_repeat_kv(site)  # HF repeats K/V before SDPA when it passes a mask
        structure_site(site)
    return site


def match_sdpa_backend(node: fx.Node) -> Site | None:
    """``aten._scaled_dot_product_*_attention`` whose only use is its output."""
    if node_kind(node) != "sdpa_backend":
        return None
    users = list(node.users)
    if not users or not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
        return None
    dropout, causal, scale, mask = SDPA_BACKENDS[node.target]
    q, k, v = node.args[:3]
    site = Site("sdpa", users[0] if len(users) == 1 else node, q=q, k=k, v=v, name=module_path(node))
    get = lambda i, default=None: node.args[i] if i is not None and i < len(node.args) else default  # noqa: E731
    site.attn_mask, site.scale = get(mask), get(scale)
    site.causal = get(causal, False) is True
    if len(users) != 1:
        site.unsupported = "the backend op's output is used more than once"
    elif get(dropout, 0.0) != 0:
        site.unsupported = "dropout_p > 0 (dropout is not implemented in low precision)"
    elif site.attn_mask is not None and site.causal:
        site.unsupported = "attn_mask together with is_causal"
    elif _heads(q) != _heads(k):
        site.unsupported = "query and key head counts differ"
    if site.unsupported is None:
        structure_site(site)
    return site


def _mask_reason(mask, q) -> str | None:
    """SDPA takes a mask of two or more dimensions, boolean, float32 or of the query's
    dtype, and raises on any other (an integer 0/1 mask, say), which the low-precision
    path would read as a bias: left to SDPA, which raises (the eager drop-in) or has
    raised (a traced call)."""
    mask, q = value(mask), value(q)
    if not (isinstance(mask, torch.Tensor) and isinstance(q, torch.Tensor)):
        return None
    if mask.dim() < 2:
        return f"attn_mask of {mask.dim()} dimensions (SDPA refuses it)"
    if mask.dtype not in (torch.bool, torch.float32, q.dtype):
        return f"attn_mask dtype {mask.dtype} with {q.dtype} inputs (SDPA refuses it)"
    return None


def _heads(node) -> int | None:
    val = value(node)
    return val.shape[1] if val is not None and val.dim() == 4 else None
