"""``F.scaled_dot_product_attention`` calls in the Dynamo graph."""

from __future__ import annotations

import torch.fx as fx

from .common import Site, arg, kind, module_path, strip_repeat_kv, value
from .masks import structure_site


def match_sdpa(node: fx.Node) -> Site | None:
    if kind(node) != "sdpa":
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
    site.causal = bool(causal) if isinstance(causal, bool) else False
    if site.unsupported is None:
        strip_repeat_kv(site)  # HF repeats K/V before SDPA when it passes a mask
        structure_site(site)
    return site


def _heads(node) -> int | None:
    val = value(node)
    return val.shape[1] if val is not None and val.dim() == 4 else None
