"""Key-padding biases for the forward kernels: one log2 bias row per (batch, head), the
same for every query (``formats.mask_to_log2_bias`` of a ``[B, Nk]`` key-padding vector,
or any additive bias that does not vary over queries), and which of its key tiles a
kernel may skip (every forward and backward kernel; the Triton ones behind
``TRITON_SKIPS_MASKED_TILES``) or run without the bias (the Gluon forward).

A padded batch row keeps one contiguous run of keys (right padding in training, left
padding in generation), so its tiles are: wholly masked (skipped: every bias at or below
``formats.MASKED_LOG2`` gives P = 0, and a row left with no tile is a row with no
visible key, as in the reference), wholly zero (the unmasked path, without reading the
bias), and at most one edge tile at each end, which adds the bias.  ``tile_ranges``
finds those on the device, in one small launch and no host synchronisation; a bias row
of other values simply has no zero run and adds the bias in every tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import formats as F

TILES_PER_STEP = 16  # key tiles each step of _tile_ranges reads (2048 biases at 128 keys)
# The Triton kernels (forward, dQ, dK/dV) skip the key tiles a key-row bias masks wholly
# (exact; measured on the H200, docs/perf-notes/2026-12.md, "The Triton key-tile skipping
# on the H200").  A switch so that a benchmark or test
# can run them over every tile; the Gluon forward always skips.
TRITON_SKIPS_MASKED_TILES = True


def key_rows(bias: torch.Tensor, b: int, h: int, nq: int, nk: int):
    """``bias`` (broadcastable to [B, H, Nq, Nk]) as float32 rows [R, Nk] with the row of
    (batch, head) at ``batch * row_b + head * row_h``: (rows, row_b, row_h); None where
    the bias varies over queries (the Triton kernel's dense path takes those)."""
    if not key_row_bias(bias, b, h, nq, nk):
        return None
    full = bias.expand(b, h, nq, nk)[:, :, 0, :]
    if full.stride(1) == 0 or h == 1:
        return full[:, 0].float().contiguous(), 1, 0
    if full.stride(0) == 0 or b == 1:
        return full[0].float().contiguous(), 0, 1
    return full.float().reshape(b * h, nk).contiguous(), h, 1


def key_row_bias(bias: torch.Tensor, b: int, h: int, nq: int, nk: int) -> bool:
    """Whether ``bias`` is the same row of key biases for every query."""
    if not bias.is_floating_point() or bias.dim() != 4:
        return False
    try:
        full = bias.expand(b, h, nq, nk)
    except RuntimeError:
        return False
    return full.stride(2) == 0 or nq == 1


@triton.jit
def _tile_ranges(rows_ptr, out_ptr, NK, TILES, MASKED: tl.constexpr, BN: tl.constexpr, STEP: tl.constexpr):
    """Per bias row: the first and one past the last tile with a key that is not masked
    (bias above MASKED, or NaN), and the run of tiles whose biases are all zero (empty
    unless those tiles are contiguous).  Keys past NK count as masked, not zero."""
    r = tl.program_id(0)
    base = rows_ptr + r.to(tl.int64) * NK
    cols = tl.arange(0, BN)
    lo = TILES
    hi = TILES * 0
    z_lo = TILES
    z_hi = TILES * 0
    n_zero = TILES * 0
    for t0 in range(0, TILES, STEP):
        tile = t0 + tl.arange(0, STEP)
        keys = tile[:, None] * BN + cols[None, :]
        x = tl.load(base + keys, mask=keys < NK, other=MASKED)
        kept = tl.max(((x > MASKED) | (x != x)).to(tl.int32), 1) > 0  # NaN counts as kept
        zero = tl.min((x == 0.0).to(tl.int32), 1) > 0
        lo = tl.minimum(lo, tl.min(tl.where(kept, tile, TILES)))
        hi = tl.maximum(hi, tl.max(tl.where(kept, tile + 1, 0)))
        z_lo = tl.minimum(z_lo, tl.min(tl.where(zero, tile, TILES)))
        z_hi = tl.maximum(z_hi, tl.max(tl.where(zero, tile + 1, 0)))
        n_zero += tl.sum(zero.to(tl.int32))
    z_hi = tl.where(n_zero == z_hi - z_lo, z_hi, z_lo)
    i = tl.arange(0, 4)
    tl.store(out_ptr + r * 4 + i, tl.where(i == 0, lo, tl.where(i == 1, hi, tl.where(i == 2, z_lo, z_hi))))


class KeyRows:
    """One call's key-row bias as its kernels read it: ``key_rows``' rows, and their
    ``tile_ranges`` per tile size, each launched when a kernel first asks for it.  A
    backward builds one and hands it to the kernels it launches (Gluon or Triton, dQ and
    dK/dV), which share one copy of the rows and one ranges launch (three of each before).
    Per call, never cached across calls: under CUDA graphs the bias is new data in the
    same tensor at each replay."""

    def __init__(self, rows: torch.Tensor, row_b: int, row_h: int):
        self.rows, self.row_b, self.row_h = rows, row_b, row_h
        self._ranges: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, bias, b: int, h: int, nq: int, nk: int) -> "KeyRows | None":
        """The call's key rows (``key_rows``), or None without a key-row bias."""
        found = None if bias is None else key_rows(bias, b, h, nq, nk)
        return None if found is None else cls(*found)

    def ranges(self, block_n: int) -> torch.Tensor:
        if block_n not in self._ranges:
            self._ranges[block_n] = tile_ranges(self.rows, block_n)
        return self._ranges[block_n]


def launch_rows(rows: KeyRows | None, block_n: int, placeholder: torch.Tensor):
    """What a kernel taking a key-row bias is launched with: (the rows, their tile ranges
    in tiles of ``block_n`` keys, row_b, row_h); without one ``placeholder`` stands for
    both tensors (never read)."""
    if rows is None:
        return placeholder, placeholder, 0, 0
    return rows.rows, rows.ranges(block_n), rows.row_b, rows.row_h


def skip_ranges(rows: KeyRows | None, block_n: int):
    """For the Triton kernels: ``(tile_ranges, row_b, row_h)`` of a key-row bias when they
    skip its wholly masked tiles (``TRITON_SKIPS_MASKED_TILES``), else None."""
    if rows is None or not TRITON_SKIPS_MASKED_TILES:
        return None
    return rows.ranges(block_n), rows.row_b, rows.row_h


@triton.jit
def kept_keys(ranges, lo, hi, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) (lo a multiple of BLOCK_N) narrowed to the tiles that keep a key, from
    a ``tile_ranges`` row at ``ranges``; empty (lo == hi) where none does."""
    hi = tl.minimum(hi, tl.load(ranges + 1) * BLOCK_N)
    return tl.minimum(tl.maximum(lo, tl.load(ranges) * BLOCK_N), hi), hi


def tile_ranges(rows: torch.Tensor, block_n: int) -> torch.Tensor:
    """int32 [R, 4] of ``key_rows``' rows: (first kept tile, one past the last kept tile,
    first and one past the last tile of the zero run) in tiles of ``block_n`` keys."""
    r, nk = rows.shape
    out = torch.empty(r, 4, dtype=torch.int32, device=rows.device)
    _tile_ranges[(r,)](rows, out, nk, triton.cdiv(nk, block_n), MASKED=F.MASKED_LOG2, BN=block_n,
                       STEP=TILES_PER_STEP)
    return out
