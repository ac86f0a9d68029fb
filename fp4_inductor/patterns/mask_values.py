"""The values ``masks.py``'s evaluator gives the nodes of a mask-building graph: index
tensors, constants, and conjunctions of bounds (``Structure``), whose offsets are affine
in graph values."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .common import value

# Offsets are affine in graph values: (constant, ((node, coefficient), ...)), so that a
# cache offset held in a SymInt node (dynamic shapes) cancels where it should.
ZERO = (0, ())


def affine(x) -> tuple | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return (x, ())
    if isinstance(x, fx.Node) and isinstance(value(x), torch.SymInt):
        return (0, ((x, 1),))
    return None


def add(a, b, sign=1):
    terms = dict(a[1])
    for node, c in b[1]:
        terms[node] = terms.get(node, 0) + sign * c
    return (a[0] + sign * b[0], tuple((n, c) for n, c in terms.items() if c))


@dataclasses.dataclass(frozen=True)
class Index:
    """An integer tensor equal to its row (dim -2) or column (dim -1) index plus ``offset``,
    or to its batch index (dim -4)."""

    dim: int
    offset: tuple = ZERO


@dataclasses.dataclass(frozen=True)
class Delta:
    """``sign * (col - row) + offset``: the difference of the column and row indices."""

    sign: int
    offset: tuple = ZERO


@dataclasses.dataclass(frozen=True)
class Arange:
    """A 1-D ``arange(n) + offset`` not yet placed on a dimension."""

    offset: tuple = ZERO


@dataclasses.dataclass(frozen=True)
class Const:
    value: bool


@dataclasses.dataclass(frozen=True)
class Fill:
    """An integer tensor with one (affine) value everywhere: what HF's packed-sequence
    detection computes from default position ids (``(diff(pos) != 1).cumsum(-1)``, all 0)."""

    value: tuple


@dataclasses.dataclass(frozen=True)
class Not:
    """The complement of a structure with no simpler form (``~(tril & ~tril(-w))``, which
    a drop mask undoes)."""

    inner: object


@dataclasses.dataclass(frozen=True)
class Ids:
    """An integer tensor of document ids (or positions) placed on the scores' axes: equal to
    ``source[b, i + offset]`` (``source`` ``[B, N]``, ``batch`` the batch's dim) or to
    ``source[i + offset]`` (``[N]``, ``batch`` None), with ``i`` the row (``dim`` -2) or
    column (-1) index; dims count from the end.  ``positions``: the position ids that
    ``source`` is HF's packed-sequence ids of (``Packed``), if it is."""

    source: fx.Node
    dim: int
    batch: int | None
    offset: tuple = ZERO
    positions: fx.Node | None = None


@dataclasses.dataclass(frozen=True)
class Structure:
    """A conjunction: ``col - row <= upper`` and ``col - row > lower`` (either may be None),
    keys kept by ``keep[b, col + pad_offset]`` for each ``(keep, pad_offset)`` in ``pads``,
    queries and keys of one document for each ``(query Ids, key Ids)`` in ``documents``,
    and bounds on the difference of two position ids rather than of the indices,
    ``(positions, upper, lower)`` in ``positions`` (HF's packed-sequence masks compare
    positions; ``packed.resolve`` turns them into index bounds)."""

    upper: tuple | None = None
    lower: tuple | None = None
    pads: tuple = ()
    documents: tuple = ()
    positions: tuple = ()

    def __and__(self, other: "Structure") -> "Structure | None":
        upper = tighter(self.upper, other.upper, min)
        lower = tighter(self.lower, other.lower, max)
        if upper is False or lower is False:
            return None
        positions = dict((p[0], p[1:]) for p in self.positions)
        for source, up, low in other.positions:
            if source in positions:
                up, low = tighter(positions[source][0], up, min), tighter(positions[source][1], low, max)
                if up is False or low is False:
                    return None
            positions[source] = (up, low)
        documents = self.documents + tuple(d for d in other.documents if d not in self.documents)
        return Structure(upper, lower, self.pads + other.pads, documents,
                         tuple((source, *bounds) for source, bounds in positions.items()))


def tighter(a, b, pick):
    if a is None or b is None:
        return a if b is None else b
    if a == b:
        return a
    if a[1] == b[1]:  # same symbolic part: compare the constants
        return (pick(a[0], b[0]), a[1])
    return False  # bounds that cannot be compared at compile time
