"""Document structure in the Triton kernels (``fp4_inductor/documents.py``): which key
tiles a query tile walks, and which query tiles a key tile does, from the ranges the
launchers compute on the device, and the same-document test of a tile's scores."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import documents as D

RANGE_ROWS = tl.constexpr(D.RANGE_ROWS)


@triton.jit
def key_range(ranges, m0, n_entries, lo, full_lo, full_hi, hi, NK, BLOCK_M: tl.constexpr):
    """The key range (lo, full_lo, full_hi, hi) of queries [m0, m0 + BLOCK_M) narrowed to
    their documents' keys: ``ranges`` points at the batch row's ``documents.key_ranges``
    (``n_entries`` of RANGE_ROWS queries each).  A tile of several entries walks the union
    of their keys and runs unmasked only the tiles whole for all of them."""
    d_lo = NK
    d_hi = 0
    d_full_lo = 0
    d_full_hi = NK
    for i in tl.static_range(BLOCK_M // RANGE_ROWS):
        entry = m0 // RANGE_ROWS + i
        ok = entry < n_entries  # entries past the queries: neutral
        d_lo = tl.minimum(d_lo, tl.load(ranges + entry * 4, mask=ok, other=NK))
        d_hi = tl.maximum(d_hi, tl.load(ranges + entry * 4 + 1, mask=ok, other=0))
        d_full_lo = tl.maximum(d_full_lo, tl.load(ranges + entry * 4 + 2, mask=ok, other=0))
        d_full_hi = tl.minimum(d_full_hi, tl.load(ranges + entry * 4 + 3, mask=ok, other=NK))
    hi = tl.minimum(hi, d_hi)
    lo = tl.minimum(tl.maximum(lo, d_lo), hi)
    full_lo = tl.minimum(tl.maximum(tl.maximum(full_lo, d_full_lo), lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.minimum(full_hi, d_full_hi), full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(ranges, lo, hi, BLOCK_M: tl.constexpr):
    """Queries [lo, hi) of a key tile (lo a multiple of BLOCK_M) narrowed to its keys'
    documents: ``ranges`` points at the tile's ``documents.query_ranges`` entry."""
    hi = tl.minimum(hi, tl.load(ranges + 1))
    return tl.minimum(tl.maximum(lo, tl.load(ranges) // BLOCK_M * BLOCK_M), hi), hi


def launch_args(q_documents, k_documents, block_n: int, placeholder: torch.Tensor, query_ranges: bool = False):
    """What a kernel is launched with: the query ids, the key ids, their ranges
    (``documents.key_ranges``, or ``query_ranges`` per key tile), and the three tensors'
    batch strides; without documents ``placeholder`` stands for each tensor (never read)."""
    if q_documents is None:
        return placeholder, placeholder, placeholder, 0, 0, 0
    q_documents, k_documents = q_documents.contiguous(), k_documents.contiguous()
    ranges = (D.query_ranges if query_ranges else D.key_ranges)(q_documents, k_documents, block_n)
    return q_documents, k_documents, ranges, q_documents.stride(0), k_documents.stride(0), ranges.stride(0)
