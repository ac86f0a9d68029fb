"""What rewritten graphs call at run time, besides ``attention.lowp_attention`` itself:
the mask combination, the BF16 causal path, and the computations of the fused module calls
(``nn.MultiheadAttention``'s functional form, PyTorch's inference fast paths) with their
attention in low precision.  ``patterns/`` only finds sites and inserts calls of these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf

from . import formats
from .attention import lowp_attention


def combine_masks(attn_mask, bias_terms, keep_masks, drop_masks):
    """One additive mask (-inf where masked) from a site's masks: an SDPA-style
    ``attn_mask`` (boolean True keeps), ``(mask, factor)`` additive terms, and boolean
    masks that keep or drop where True.  Called inside rewritten graphs."""
    if attn_mask is not None:  # SDPA's mask is one more keep mask or additive term
        if attn_mask.dtype == torch.bool:
            keep_masks = (attn_mask, *keep_masks)
        else:
            bias_terms = ((attn_mask, 1.0), *bias_terms)
    total = None
    for mask, factor in bias_terms:
        term = mask.float() * factor
        total = term if total is None else total + term
    for keep, drop in [(m, False) for m in keep_masks] + [(m, True) for m in drop_masks]:
        masked = keep if drop else ~keep
        fill = torch.zeros(masked.shape, dtype=torch.float32, device=masked.device).masked_fill(masked, float("-inf"))
        total = fill if total is None else total + fill
    return total


def causal_sdpa(q, k, v, attn_mask=None, scale=None, is_causal=True, *, fmt=None, p_mode=None, diagonal=0,
                window=0, empty_rows="zero"):
    """The BF16 path of a site whose mask the matchers read as SDPA's own causal structure
    (HF models hand a traced graph a dense ``[B, 1, N, N]`` mask even without padding):
    SDPA with ``is_causal`` and no mask tensor, which Inductor lowers to the flash/cuDNN
    kernels that skip the masked half, where the dense mask runs their bias path over every
    score.  ``lowp_attention``'s signature, so that ``replace_site`` can call it."""
    assert is_causal and attn_mask is None and not window and isinstance(diagonal, int) and diagonal == 0
    if not isinstance(scale, (int, float, type(None))):  # SDPA takes a float
        q, scale = formats.fold_scale(q, scale), 1.0
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        # The K/V the matchers un-repeated: repeated again as the model did, which keeps the
        # cuDNN backend (it takes no enable_gqa) eligible.
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return nnf.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


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


def mha_lowp(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
             key_padding_mask, attn_mask, is_causal, q_proj_weight, k_proj_weight, v_proj_weight, *,
             attention=lowp_attention, **options):
    """``torch.nn.functional.multi_head_attention_forward`` with ``need_weights=False`` on
    sequence-first ``[L, N, E]`` inputs, or one unbatched ``[L, E]`` sequence, the attention by
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
        nnf.linear(x, w, b).unflatten(-1, (num_heads, -1)).permute(1, 2, 0, 3)  # [N, H, L, D]
        for x, w, b in zip((query, key, value), weights, biases)
    )
    # The is_causal hint replaces attn_mask when no key padding is given, as upstream does.
    if is_causal and key_padding_mask is None:
        attn_mask = None
    else:
        is_causal = False
    out = attention(q, k, v, attn_mask=_sdpa_mask(attn_mask, key_padding_mask, batch, num_heads),
                    is_causal=is_causal, **options)
    out = nnf.linear(out.permute(2, 0, 1, 3).reshape(length, batch, embed), out_proj_weight, out_proj_bias)
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


def _attention(q_in, k_in, v_in, heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type, attention,
               options):
    """The fused ops' attention on batch-first ``[B, L, E]`` inputs."""
    b, lq, e = q_in.shape
    if q_in is k_in is v_in:
        q, k, v = nnf.linear(q_in, qkv_weight, qkv_bias).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)
    else:
        weights, biases = qkv_weight.chunk(3), qkv_bias.chunk(3) if qkv_bias is not None else (None,) * 3
        q, k, v = (nnf.linear(x, w, bias).unflatten(-1, (heads, -1)).transpose(1, 2)
                   for x, w, bias in zip((q_in, k_in, v_in), weights, biases))
    attn_mask = None
    if mask is not None:
        # 0: [L, L]; 1: key padding [B, L]; 2: [B, H, L, L].  Boolean masks drop where True.
        attn_mask = mask[:, None, None, :] if mask_type == 1 else mask
        if attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask
    out = attention(q, k, v, attn_mask=attn_mask, **options,
                    empty_rows="sdpa" if attn_mask is not None and attn_mask.dtype != torch.bool else "zero")
    return nnf.linear(out.transpose(1, 2).reshape(b, lq, e), proj_weight, proj_bias)


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
        hidden = nnf.linear(x, ffn_weight_1, ffn_bias_1)
        return nnf.linear(nnf.gelu(hidden) if use_gelu else nnf.relu(hidden), ffn_weight_2, ffn_bias_2)

    def norm1(x):
        return nnf.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x):
        return nnf.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    if norm_first:
        x = src + attend(norm1(src))
        return x + feed_forward(norm2(x))
    x = norm1(src + attend(src))
    return norm2(x + feed_forward(x))
