"""``nn.MultiheadAttention`` (and ``nn.Transformer*Layer``, torchvision's ViT), which
Dynamo keeps as one opaque ``F.multi_head_attention_forward`` call.

The replacement does what that function does on its common path (in-projection, heads,
attention, out-projection) with ``lowp_attention`` for the attention.  Sites that need
the averaged weights, ``bias_k``/``bias_v``, ``add_zero_attn``, static K/V or dropout in
training stay as written.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..attention import combine_masks, lowp_attention
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
    if node.op != "call_function" or node.target is not F.multi_head_attention_forward:
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


def mha_lowp(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
             key_padding_mask, attn_mask, is_causal, q_proj_weight, k_proj_weight, v_proj_weight, *,
             attention=lowp_attention, **options):
    """``F.multi_head_attention_forward`` with ``need_weights=False`` on sequence-first
    ``[L, N, E]`` inputs, or one unbatched ``[L, E]`` sequence, the attention by
    ``attention(q, k, v, attn_mask=, is_causal=, **options)``."""
    unbatched = query.dim() == 2
    if unbatched:  # a batch of one, as upstream does
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
    length, batch, embed = query.shape
    if q_proj_weight is not None:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        weights = in_proj_weight.chunk(3)
    biases = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    q, k, v = (
        F.linear(x, w, b).unflatten(-1, (num_heads, -1)).permute(1, 2, 0, 3)  # [N, H, L, D]
        for x, w, b in zip((query, key, value), weights, biases)
    )
    # The is_causal hint replaces attn_mask when no key padding is given, as upstream does.
    if is_causal and key_padding_mask is None:
        attn_mask = None
    else:
        is_causal = False
    out = attention(q, k, v, attn_mask=_sdpa_mask(attn_mask, key_padding_mask, batch, num_heads),
                    is_causal=is_causal, **options)
    out = F.linear(out.permute(2, 0, 1, 3).reshape(length, batch, embed), out_proj_weight, out_proj_bias)
    return (out.squeeze(1) if unbatched else out), None


def _sdpa_mask(attn_mask, key_padding_mask, batch: int, heads: int):
    """MHA's masks as one SDPA mask.  MHA's boolean masks mean "masked out" where True
    (the opposite of SDPA's); float masks add."""
    masks = []
    if attn_mask is not None:
        masks.append(attn_mask.unflatten(0, (batch, heads)) if attn_mask.dim() == 3 else attn_mask)  # [N*H, L, S]
    if key_padding_mask is not None:
        masks.append(key_padding_mask[:, None, None, :])  # [N, 1, 1, S]
    if not masks:
        return None
    additive = tuple((m, 1.0) for m in masks if m.dtype != torch.bool)
    return combine_masks(None, additive, (), tuple(m for m in masks if m.dtype == torch.bool))


def _mha_call(graph: fx.Graph, site: Site, attention, options: dict) -> fx.Node:
    a = mha_args(site.anchor)
    args = (a["query"], a["key"], a["value"], a["num_heads"], a["in_proj_weight"], a["in_proj_bias"],
            a["out_proj_weight"], a["out_proj_bias"], a["key_padding_mask"], a["attn_mask"], a["is_causal"],
            a["q_proj_weight"] if a["use_separate_proj_weight"] else None,
            a["k_proj_weight"] if a["use_separate_proj_weight"] else None,
            a["v_proj_weight"] if a["use_separate_proj_weight"] else None)
    kwargs = {"fmt": options["fmt"], "p_mode": options["p_mode"], "empty_rows": site.empty_rows, **options}
    return graph.call_function(bind_attention(mha_lowp, attention), args, kwargs)


def bind_attention(fn, attention):
    """``fn`` (a run-time function taking ``attention=``) calling ``attention``: itself for
    ``lowp_attention``, else a closure (FX writes keyword arguments as literals, and a
    function has none; a call target it registers by name)."""
    if attention is lowp_attention:
        return fn

    def call(*args, **kwargs):
        return fn(*args, attention=attention, **kwargs)

    call.__name__ = call.__qualname__ = fn.__name__
    return call
