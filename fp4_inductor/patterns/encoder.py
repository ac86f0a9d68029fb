"""PyTorch's fused inference fast paths: ``nn.TransformerEncoderLayer`` (and
``TransformerEncoder``) in eval under ``no_grad`` call ``torch._transformer_encoder_layer_fwd``,
``nn.MultiheadAttention`` calls ``torch._native_multi_head_attention``; Dynamo keeps each as
one opaque call.  The replacement computes what the fused op computes (batch-first
projections, heads, attention, out-projection; for the layer the residuals, layer norms
and feed-forward too) with ``lowp_attention`` for the attention.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..attention import lowp_attention
from .common import Site, module_path, value
from .mha import bind_attention

_LAYER = torch._transformer_encoder_layer_fwd
_MHA = torch._native_multi_head_attention


def _is_fast_path(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_LAYER, _MHA)


def _fast_path_mask(node: fx.Node):
    """The fused call's mask argument (None where absent)."""
    return node.args[9] if node.target is _MHA else node.args[18]


def match_fast_path(node: fx.Node) -> Site | None:
    if not _is_fast_path(node):
        return None
    src = node.args[0]
    heads = node.args[4] if node.target is _MHA else node.args[2]
    x = value(src)
    site = Site("fast-path", node, q=src, k=node.args[1] if node.target is _MHA else src,
                v=node.args[2] if node.target is _MHA else src, name=module_path(node),
                call_masks=(_fast_path_mask(node),), rewrite=_fast_path_call)
    site.weights = (node.args[5] if node.target is _MHA else node.args[3],)
    keys = value(site.k)
    site.dims = (x.shape[0], heads, heads, x.shape[1], keys.shape[1], x.shape[-1] // heads)
    mask = _fast_path_mask(node)
    site.mask_note = "none" if mask is None else "padding" if _mask_type(node) == 1 else "dense"
    if node.target is _MHA and node.args[10] is not False:
        site.unsupported = "attention weights are returned (need_weights=True)"
    elif not isinstance(heads, int) or not isinstance(_mask_type(node), (int, type(None))):
        site.unsupported = "num_heads or the mask type is not a constant"
    return site


def _mask_type(node: fx.Node):
    return node.args[12] if node.target is _MHA else node.args[19]


def _attention(q_in, k_in, v_in, heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type, attention,
               options):
    """The fused ops' attention on batch-first ``[B, L, E]`` inputs."""
    b, lq, e = q_in.shape
    if q_in is k_in is v_in:
        q, k, v = F.linear(q_in, qkv_weight, qkv_bias).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)
    else:
        weights, biases = qkv_weight.chunk(3), qkv_bias.chunk(3) if qkv_bias is not None else (None,) * 3
        q, k, v = (F.linear(x, w, bias).unflatten(-1, (heads, -1)).transpose(1, 2)
                   for x, w, bias in zip((q_in, k_in, v_in), weights, biases))
    attn_mask = None
    if mask is not None:
        # 0: [L, L]; 1: key padding [B, L]; 2: [B, H, L, L].  Boolean masks drop where True.
        attn_mask = mask[:, None, None, :] if mask_type == 1 else mask
        if attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask
    out = attention(q, k, v, attn_mask=attn_mask, **options,
                    empty_rows="sdpa" if attn_mask is not None and attn_mask.dtype != torch.bool else "zero")
    return F.linear(out.transpose(1, 2).reshape(b, lq, e), proj_weight, proj_bias)


def native_mha_lowp(query, key, value, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask=None,
                    need_weights=True, average_attn_weights=True, mask_type=None, *, attention=lowp_attention,
                    **options):
    """``torch._native_multi_head_attention`` with ``need_weights=False``, attention in low precision."""
    out = _attention(query, key, value, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type,
                     attention, options)
    return out, None


def encoder_layer_lowp(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first,
                       eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                       ffn_weight_2, ffn_bias_2, mask=None, mask_type=None, *, attention=lowp_attention, **options):
    """``torch._transformer_encoder_layer_fwd`` (eval: no dropout), attention in low precision."""

    def attend(x):
        return _attention(x, x, x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type,
                          attention, options)

    def feed_forward(x):
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2)

    def norm1(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    if norm_first:
        x = src + attend(norm1(src))
        return x + feed_forward(norm2(x))
    x = norm1(src + attend(src))
    return norm2(x + feed_forward(x))


def _fast_path_call(graph: fx.Graph, site: Site, attention, options: dict) -> fx.Node:
    node = site.anchor
    target = native_mha_lowp if node.target is _MHA else encoder_layer_lowp
    return graph.call_function(bind_attention(target, attention), node.args, {**node.kwargs, **options})
