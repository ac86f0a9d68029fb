"""``nn.MultiheadAttention`` (and ``nn.Transformer*Layer``, torchvision's ViT), which
Dynamo keeps as one opaque ``torch.nn.functional.multi_head_attention_forward`` call.

The replacement, ``runtime.mha_lowp``, does what that function does on its common path
(in-projection, heads, attention, out-projection) with ``lowp_attention`` for the
attention.  Sites that need the averaged weights, ``bias_k``/``bias_v``, ``add_zero_attn``,
static K/V or dropout in training stay as written.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as nnf

from ..runtime import bind_attention, mha_lowp
from .common import Site, arg, module_path, value

_PARAMS = (
    "query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k",
    "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training", "key_padding_mask",
    "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
    "static_k", "static_v", "average_attn_weights", "is_causal",
)
_DEFAULTS = {"training": True, "need_weights": True, "use_separate_proj_weight": False, "is_causal": False,
             "average_attn_weights": True}


def mha_args(node: fx.Node) -> dict:
    return {name: arg(node, i, name, _DEFAULTS.get(name)) for i, name in enumerate(_PARAMS)}


def match_mha(node: fx.Node) -> Site | None:
    if node.op != "call_function" or node.target is not nnf.multi_head_attention_forward:
        return None
    a = mha_args(node)
    site = Site("mha", node, q=a["query"], k=a["key"], v=a["value"], causal=bool(a["is_causal"]),
                name=module_path(node), call_masks=(a["attn_mask"], a["key_padding_mask"]), rewrite=_mha_call)
    query, key = value(a["query"]), value(a["key"])
    heads = a["num_heads"]
    site.weights = tuple(a[n] for n in ("in_proj_weight", "q_proj_weight") if a[n] is not None)
    batch = query.shape[1] if query.dim() == 3 else 1  # [L, E]: one unbatched sequence
    masks = [m for m in (a["attn_mask"], a["key_padding_mask"]) if m is not None]
    site.mask_note = ("dense" if a["attn_mask"] is not None else "padding" if masks else
                      "causal" if site.causal else "none")
    if any(value(m).dtype != torch.bool for m in masks):
        site.empty_rows = "sdpa"  # MHA runs SDPA: -inf rows give zeros, finite fills the mean of V
    site.dims = (batch, heads, heads, query.shape[0], key.shape[0], query.shape[-1] // heads)
    if a["need_weights"] is not False:
        site.unsupported = "attention weights are returned (need_weights=True)"
    elif any(a[n] is not None for n in ("bias_k", "bias_v", "static_k", "static_v")) or a["add_zero_attn"]:
        site.unsupported = "bias_k/bias_v, static K/V or add_zero_attn"
    elif a["dropout_p"] != 0 and a["training"] is not False:
        site.unsupported = "dropout in training (not implemented in low precision)"
    elif not isinstance(a["is_causal"], bool) or not isinstance(heads, int):
        site.unsupported = "is_causal or num_heads is not a constant"
    return site


def _mha_call(graph: fx.Graph, site: Site, attention, options: dict) -> fx.Node:
    a = mha_args(site.anchor)
    args = (a["query"], a["key"], a["value"], a["num_heads"], a["in_proj_weight"], a["in_proj_bias"],
            a["out_proj_weight"], a["out_proj_bias"], a["key_padding_mask"], a["attn_mask"], a["is_causal"],
            a["q_proj_weight"] if a["use_separate_proj_weight"] else None,
            a["k_proj_weight"] if a["use_separate_proj_weight"] else None,
            a["v_proj_weight"] if a["use_separate_proj_weight"] else None)
    kwargs = {"fmt": options["fmt"], "p_mode": options["p_mode"], "empty_rows": site.empty_rows, **options}
    return graph.call_function(bind_attention(mha_lowp, attention), args, kwargs)
