"""PyTorch's fused inference fast paths: ``nn.TransformerEncoderLayer`` (and
``TransformerEncoder``) in eval under ``no_grad`` call ``torch._transformer_encoder_layer_fwd``,
``nn.MultiheadAttention`` calls ``torch._native_multi_head_attention``; Dynamo keeps each as
one opaque call.  The replacement computes what the fused op computes (batch-first
projections, heads, attention, out-projection; for the layer the residuals, layer norms
and feed-forward too), ``runtime.native_mha_lowp`` and ``runtime.encoder_layer_lowp``, with
``lowp_attention`` for the attention.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime import bind_attention, encoder_layer_lowp, native_mha_lowp
from .common import Site, module_path, value

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


def _fast_path_call(graph: fx.Graph, site: Site, attention, options: dict) -> fx.Node:
    node = site.anchor
    target = native_mha_lowp if node.target is _MHA else encoder_layer_lowp
    return graph.call_function(bind_attention(target, attention), node.args, {**node.kwargs, **options})
