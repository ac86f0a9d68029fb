"""Document structure: several sequences packed into one, attending only within themselves.

Query ``i`` of batch row ``b`` may see key ``j`` only if ``q_documents[b, i] ==
k_documents[b, j]`` (integer ids ``[B, Nq]`` and ``[B, Nk]``, any values), on top of the
causal structure (``formats.visible``) and key padding.  Packed data numbers its
documents in order along the sequence, so each document's keys are one contiguous run
and a query tile sees only the key tiles of its own documents: ``key_ranges`` and
``query_ranges`` find them on the device (no host synchronisation), and the reference
and the kernels skip every tile outside.  Ids that are not sorted along the sequence are
still exact, without the skipping.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

# Query rows per ``key_ranges`` entry: the Triton kernels' row tiles are 64 or 128 rows
# (128 combines two entries), the dQ kernel's 64.
RANGE_ROWS = 64


def same_document(q_documents: torch.Tensor, k_documents: torch.Tensor, rows=slice(None), keys=slice(None)
                  ) -> torch.Tensor:
    """``[B, 1, rows, keys]`` boolean: which (query, key) pairs share a document."""
    return (q_documents[:, rows, None] == k_documents[:, None, keys])[:, None]


def _sorted(ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: whether each row's ids never decrease."""
    return (ids[:, 1:] >= ids[:, :-1]).all(dim=-1, keepdim=True)


def _tiles(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The least and greatest id of each ``block`` tokens of ``ids`` [B, N]: [B, ceil(N / block)] each.
    The last tile is padded with its last id (which moves neither where ids are sorted)."""
    b, n = ids.shape
    tiles = -(-n // block)
    padded = torch.cat([ids, ids[:, -1:].expand(b, tiles * block - n)], dim=1).view(b, tiles, block)
    return padded.amin(dim=-1), padded.amax(dim=-1)


def key_ranges(q_documents: torch.Tensor, k_documents: torch.Tensor, block_n: int, rows: int = RANGE_ROWS
               ) -> torch.Tensor:
    """int32 ``[B, ceil(Nq / rows), 4]``: for each ``rows`` queries the keys ``[lo, hi)``
    holding every key of their documents (``lo`` a multiple of ``block_n``), and the key
    tiles ``[full_lo, full_hi)`` (multiples of ``block_n``) all of whose keys are in the
    queries' one document (empty, ``full_lo == full_hi``, where the queries span several).
    Without sorted key ids: all keys, no whole tile."""
    nk = k_documents.shape[1]
    least, most = _tiles(q_documents, rows)
    start = torch.searchsorted(k_documents, least)  # the first key of the least id
    stop = torch.searchsorted(k_documents, most, right=True)  # one past the last of the greatest
    lo = start // block_n * block_n
    one = (least == most) & _sorted(k_documents)
    full_lo = torch.where(one, (start + block_n - 1) // block_n * block_n, lo)
    full_hi = torch.where(one, torch.maximum(stop // block_n * block_n, full_lo), lo)
    ranges = torch.stack([lo, stop, full_lo, full_hi], dim=-1)
    every = torch.tensor([0, nk, 0, 0], device=ranges.device)
    return torch.where(_sorted(k_documents)[..., None], ranges, every).to(torch.int32).contiguous()


def query_ranges(q_documents: torch.Tensor, k_documents: torch.Tensor, block_n: int) -> torch.Tensor:
    """int32 ``[B, ceil(Nk / block_n), 2]``: for each key tile the queries ``[lo, hi)``
    holding every query of its keys' documents; all queries without sorted query ids."""
    least, most = _tiles(k_documents, block_n)
    ranges = torch.stack([torch.searchsorted(q_documents, least), torch.searchsorted(q_documents, most, right=True)],
                         dim=-1)
    every = torch.tensor([0, q_documents.shape[1]], device=ranges.device)
    return torch.where(_sorted(q_documents)[..., None], ranges, every).to(torch.int32).contiguous()


def pad_keys(k_documents: torch.Tensor | None, nk: int) -> torch.Tensor | None:
    """Key ids for ``nk`` keys, the appended ones (``quantized.align_keys``' padding, masked by
    its key padding) repeating the last id, which keeps sorted ids sorted."""
    if k_documents is None or statically_known_true(k_documents.shape[1] == nk):  # no guard on a symbolic length
        return k_documents
    b, n = k_documents.shape
    return torch.cat([k_documents, k_documents[:, -1:].expand(b, nk - n)], dim=1)


def check(q_documents, k_documents, b: int, nq: int, nk: int) -> None:
    """Both or neither given, integer, ``[B, Nq]`` and ``[B, Nk]``."""
    if (q_documents is None) != (k_documents is None):
        raise ValueError("q_documents and k_documents go together")
    if q_documents is None:
        return
    for name, ids, n in (("q_documents", q_documents, nq), ("k_documents", k_documents, nk)):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer document ids, got {ids.dtype}")
        if tuple(ids.shape) != (b, n):
            raise ValueError(f"{name} must be [B, N] = {(b, n)}, got {tuple(ids.shape)}")
