"""``attn_implementation="fp4attn"``: transformers' ``AttentionInterface`` and its mask
interface.

The mask function hands the attention function the mask's structure instead of a dense
``[B, 1, Nq, Nk]`` tensor wherever transformers' mask is causal, sliding-window or
bidirectional, with or without key padding (``KeyStructure``); anything else (packed
sequences, chunked attention, custom mask functions) is built dense by transformers'
``sdpa_mask`` and passed as a tensor.  The structure is read by calling the mask function
on symbolic indices (``_Offset``), so only what it computes, not its name, decides.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import create_position_bias_mask
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask, sdpa_mask

from .. import eager, formats

NAME = "fp4attn"


@dataclasses.dataclass(frozen=True)
class KeyStructure:
    """What the mask function passes for a mask it recognised: key ``j`` is visible to
    query ``i`` iff ``j <= i + diagonal`` (when ``causal``) and ``j > i + diagonal -
    window`` (a window), and ``key_padding[b, j]`` (``[B, Nk]``, True keeps)."""

    causal: bool
    diagonal: int = 0
    window: int = 0
    key_padding: torch.Tensor | None = None

    def dense(self, nq: int, nk: int, device) -> torch.Tensor:
        """The boolean mask, broadcastable to ``[B, 1, Nq, Nk]`` (for what needs one: a position bias)."""
        keep = formats.visible(torch.arange(nq, device=device)[:, None], torch.arange(nk, device=device)[None, :],
                                     self.causal, self.diagonal, self.window)
        keep = torch.ones(nq, nk, dtype=torch.bool, device=device) if keep is None else keep
        return keep if self.key_padding is None else keep & self.key_padding[:, None, None, :]


_FLIPPED = {"<=": ">=", "<": ">", ">=": "<=", ">": "<"}


@dataclasses.dataclass(frozen=True)
class _Offset:
    """A mask function's index argument: ``kind`` (``"b"``, ``"h"``, ``"q"``, ``"kv"``)
    plus ``offset``.  Comparing a key index with a query index gives the ``_Band`` of
    ``kv - q`` kept; anything else a mask function does with it raises, and the mask is
    not a band."""

    kind: str
    offset: int = 0

    def __add__(self, other):
        return _Offset(self.kind, self.offset + other) if isinstance(other, int) else NotImplemented

    def __sub__(self, other):
        return self + (-other) if isinstance(other, int) else NotImplemented

    def _compare(self, other, op: str):
        if self.kind == "q" and isinstance(other, int) and op == ">=" and other <= self.offset:
            return _Band()  # q_idx >= 0, true of every query: the bidirectional mask
        if not isinstance(other, _Offset) or {self.kind, other.kind} != {"q", "kv"}:
            return NotImplemented
        kv, q = (self, other) if self.kind == "kv" else (other, self)
        op = op if self.kind == "kv" else _FLIPPED[op]
        c = q.offset - kv.offset  # kv + a (op) q + b  <=>  kv - q (op) b - a
        return {"<=": _Band(hi=c), "<": _Band(hi=c - 1), ">=": _Band(lo=c), ">": _Band(lo=c + 1)}[op]

    def __le__(self, other):
        return self._compare(other, "<=")

    def __lt__(self, other):
        return self._compare(other, "<")

    def __ge__(self, other):
        return self._compare(other, ">=")

    def __gt__(self, other):
        return self._compare(other, ">")

    def new_ones(self, *_, **__):  # and_masks' starting value: everything kept
        return _Band()


@dataclasses.dataclass(frozen=True)
class _Band:
    """The scores kept: ``lo <= kv - q <= hi`` (None: unbounded), in absolute positions."""

    lo: int | None = None
    hi: int | None = None
    device = None  # and_masks moves each part to its result's device

    def __and__(self, other):
        if not isinstance(other, _Band):
            return NotImplemented
        pick = lambda a, b, f: b if a is None else a if b is None else f(a, b)  # noqa: E731
        return _Band(pick(self.lo, other.lo, max), pick(self.hi, other.hi, min))

    def to(self, *_, **__):
        return self


def _band_of(mask_function) -> _Band | None:
    try:
        band = mask_function(_Offset("b"), _Offset("h"), _Offset("q"), _Offset("kv"))
    except (TypeError, IndexError, AttributeError, RuntimeError):  # indexes a tensor (padding, packing): not a band
        return None
    return band if isinstance(band, _Band) else None


def mask_interface(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                   attention_mask=None, local_size=None, use_vmap=False, **kwargs):
    """transformers' mask interface for ``fp4attn``: a ``KeyStructure`` where the mask is
    a band of ``kv - q`` (causal, a sliding window, all) with the 2-D padding mask, else
    ``sdpa_mask``'s boolean mask (or its None for plain causal)."""
    band = None if use_vmap else _band_of(mask_function)  # use_vmap: a custom mask function joined
    # A StaticCache's query offset is a tensor: its mask stays dense.
    offsets_known = all(isinstance(x, (int, torch.SymInt)) for x in (q_offset, kv_offset))
    if band is None or (band.lo is not None and band.hi is None) or not offsets_known:
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         local_size=local_size, use_vmap=use_vmap, **kwargs)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset:kv_offset + kv_length]
        if not torch.compiler.is_compiling() and bool(padding.all()):
            padding = None  # as sdpa_mask skips it: without it the BF16 path keeps SDPA's is_causal
    if band.hi is None:
        return KeyStructure(False, key_padding=padding)
    diagonal = q_offset - kv_offset + band.hi
    return KeyStructure(True, diagonal, band.hi - band.lo + 1 if band.lo is not None else 0, padding)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' attention function for ``fp4attn`` (``sdpa_attention_forward``'s
    contract: ``[B, H, N, D]`` in, ``[B, N, H, D]`` out): ``eager.attention`` with the
    structure the mask function read, K/V heads shared in place (GQA)."""
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='fp4attn' does not support softcap: use 'eager' or 'flex_attention'")
    gqa = key.shape[1] != query.shape[1]
    name = eager.module_name(module)
    if isinstance(attention_mask, KeyStructure) and position_bias is not None:
        attention_mask = attention_mask.dense(query.shape[2], key.shape[2], query.device)
    if isinstance(attention_mask, KeyStructure):
        s = attention_mask
        out = eager.attention(query, key, value, None, dropout, s.causal, scaling, gqa, diagonal=s.diagonal,
                              window=s.window, key_padding=s.key_padding, name=name)
    else:
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        is_causal = query.shape[2] > 1 and attention_mask is None and is_causal  # as sdpa_attention_forward
        if position_bias is not None:
            attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
            is_causal = False
        out = eager.attention(query, key, value, attention_mask, dropout, is_causal, scaling, gqa, name=name)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, mask_interface)
