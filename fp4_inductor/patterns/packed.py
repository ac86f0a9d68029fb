"""Packed sequences in mask graphs: document ids compared by query and key.

Three spellings reach the evaluator of ``masks.py``:
- HF ``masking_utils`` with ``position_ids`` and no ``attention_mask`` (training on
  ``DataCollatorWithFlattening`` batches): ids ``(diff(pos, prepend=pos[:, :1] - 1) !=
  1).cumsum(-1)`` compared as ``ids[b, q] == ids[b, kv]``, and the causal (or window)
  bounds written on positions, ``pos[b, kv] <= pos[b, q]``.  Within one document the
  positions step by one, so those are the index bounds (``resolve``);
- a hand-written ``doc[:, None] == doc[None, :]`` (or batched, ``doc[:, None, :, None]``);
- a flex_attention mask_mod, ``document_id[q_idx] == document_id[kv_idx]``.
Any integer tensor compared this way is a document structure: the op takes the ids as
they are (``q_documents``, ``k_documents``), sliced to the call's queries and keys.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .common import arg, value
from .mask_values import ZERO, Const, Fill, Ids, Index, Not, Structure, add, affine


@dataclasses.dataclass(frozen=True)
class Source:
    """An integer tensor of a calling graph (a flex_attention mask_mod's buffer)."""

    node: fx.Node


@dataclasses.dataclass(frozen=True)
class _Steps:
    """``diff(pos, prepend=pos[:, :1] - 1)`` of position ids ``pos`` [B, N]."""

    positions: fx.Node


@dataclasses.dataclass(frozen=True)
class _Starts:
    """``steps != 1``: where a document starts."""

    positions: fx.Node


@dataclasses.dataclass(frozen=True)
class _Packed:
    """``starts.cumsum(-1)``: HF's packed-sequence ids of ``positions``."""

    positions: fx.Node


def strip(node: fx.Node) -> fx.Node:
    """``node`` without the batch broadcasts and copies in front of it (HF expands the
    position ids it compares and those it derives the ids from separately)."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("expand", "contiguous"):
        base = node.args[0]
        if not (isinstance(base, fx.Node) and value(base) is not None and value(base).dim() == value(node).dim()
                and statically_known_true(value(base).shape[-1] == value(node).shape[-1])):
            break
        node = base
    return node


def _integer(node) -> bool:
    v = value(node)
    return isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.dtype.is_complex \
        and v.dtype != torch.bool and v.dim() in (1, 2)


def evaluate(ev, node: fx.Node):
    """The value of an id-building node (``diff``, ``!=``, ``cumsum``, ``==``), else None.
    With positions a ramp (no ids passed in, nothing packed) HF's ids are all 0 (``Fill``)
    and their comparison always holds."""
    target, args = node.target, node.args
    if node.op == "call_function" and target is torch.diff:
        x, prepend = args[0], arg(node, 3, "prepend")
        if arg(node, 1, "n", 1) != 1 or arg(node, 2, "dim", -1) not in (-1, 1) or prepend is None:
            return None
        ramp = ev(x)
        if isinstance(ramp, Index) and ramp.dim == -1:
            return Fill((1, ())) if ev(prepend) == Fill(add(ramp.offset, (-1, ()))) else None
        return _Steps(strip(x)) if _integer(x) and _first_minus_one(prepend, x) else None
    if (node.op == "call_method" and target == "cumsum") or target is torch.cumsum:
        inner, dim = ev(args[0]), arg(node, 1, "dim")
        if dim not in (-1, 1):
            return None
        if inner == Const(False):
            return Fill(ZERO)
        return _Packed(inner.positions) if isinstance(inner, _Starts) else None
    eq = target in (operator.eq, torch.eq, "eq", "__eq__")
    if node.op in ("call_function", "call_method") and (eq or target in (operator.ne, torch.ne, "ne", "__ne__")):
        a, b = ev(args[0]), args[1]
        b = ev(b) if isinstance(b, fx.Node) else Fill(affine(b)) if affine(b) is not None else None
        if isinstance(a, Fill) and isinstance(b, Fill) and not a.value[1] and not b.value[1]:
            return Const((a.value == b.value) == eq)
        if isinstance(a, _Steps) and b == Fill((1, ())) and not eq:
            return _Starts(a.positions)
        if isinstance(a, Ids) and isinstance(b, Ids):
            same = _same_document(a, b)
            if same is not None:
                return same if eq else Not(same)
    return None


def _first_minus_one(prepend, x) -> bool:
    """Whether ``prepend`` is ``x[:, :1] - 1``."""
    if not (isinstance(prepend, fx.Node) and prepend.op == "call_function" and prepend.target in (operator.sub,
                                                                                                  torch.sub)):
        return False
    first, one = prepend.args[:2]
    return one == 1 and isinstance(first, fx.Node) and first.target is operator.getitem and \
        strip(first.args[0]) is strip(x) and first.args[1] == (slice(None), slice(None, 1, None))


def _same_document(a: Ids, b: Ids) -> Structure | None:
    if {a.dim, b.dim} != {-2, -1} or any(i.batch not in (None, -4) for i in (a, b)):
        return None
    q, k = (a, b) if a.dim == -2 else (b, a)
    return Structure(documents=((q, k),))


def getitem(ev, node: fx.Node, inner):
    """Ids from indexing: an integer tensor gathered by (batch, index) or by an index
    alone (flex_attention's scalars, HF's broadcast aranges), or placed on axes by
    ``None``s and full slices; None otherwise."""
    base, index = node.args
    if isinstance(inner, Ids):
        return place(inner, value(base).dim(), index)
    if isinstance(inner, Source) and _integer(inner.node):
        source = inner.node
    elif isinstance(inner, _Packed) or (inner is None and _integer(base)):
        source = base
    else:
        return None
    positions = inner.positions if isinstance(inner, _Packed) else None
    rank = value(source).dim()
    parts = index if isinstance(index, tuple) else (index,)
    if all(isinstance(p, fx.Node) for p in parts):  # a gather by index tensors
        found = [ev(p) for p in parts]
        if not all(isinstance(f, Index) for f in found) or len(found) != rank:
            return None
        if rank == 2 and (found[0].dim != -4 or found[0].offset != ZERO):
            return None
        i = found[-1]
        return Ids(strip(source), i.dim, -4 if rank == 2 else None, i.offset, positions) if i.dim in (-2, -1) else None
    axes = {"n": rank - 1, **({"batch": 0} if rank == 2 else {})}
    placed = _reindex(axes, rank, parts)
    if placed is None or placed["n"] not in (-2, -1):
        return None
    return Ids(strip(source), placed["n"], placed.get("batch"), ZERO, positions)


def place(ids: Ids, rank: int, index) -> Ids | None:
    """``ids`` (a value of ``rank`` dims) indexed by ``None``s and full slices, or
    unsqueezed (``index`` an int: the new dim)."""
    if isinstance(index, int):
        d = index + rank + 1 if index < 0 else index
        index = (slice(None),) * d + (None,)
    axes = {"n": ids.dim + rank, **({"batch": ids.batch + rank} if ids.batch is not None else {})}
    placed = _reindex(axes, rank, index if isinstance(index, tuple) else (index,))
    if placed is None:
        return None
    return dataclasses.replace(ids, dim=placed["n"], batch=placed.get("batch"))


def _reindex(axes: dict, rank: int, index: tuple) -> dict | None:
    """Where the named axes (positions from the start of ``rank`` dims) land, counted from
    the end, after indexing by full slices and ``None``s."""
    if not all(p is None or p == slice(None) for p in index):
        return None
    mapping, pos, old = {}, 0, 0
    for p in index:
        if p is None:
            pos += 1
        else:
            mapping[old], old, pos = pos, old + 1, pos + 1
    for rest in range(old, rank):
        mapping[rest], pos = pos, pos + 1
    return {name: mapping[axis] - pos for name, axis in axes.items()}


def compare(name: str, a: Ids, b: Ids, bounds) -> Structure | None:
    """``pos[b, col] ? pos[b, row]``: HF's causal and window bounds on position ids, a
    bound on their difference (``bounds(name, col, row)`` gives the index form)."""
    if strip(a.source) is not strip(b.source) or {a.dim, b.dim} != {-2, -1} or a.batch != b.batch \
            or a.offset != ZERO or b.offset != ZERO:
        return None
    found = bounds(name, Index(a.dim), Index(b.dim))
    return Structure(positions=((strip(a.source), found.upper, found.lower),))


def resolve(found: Structure, tighter) -> Structure | None:
    """``found`` with its bounds on positions written on indices, where the documents it
    also requires are HF's packed-sequence ids of those positions (within one document
    ``pos[j] - pos[i] = j - i``); None where they are not, or it needs more than one
    document structure."""
    if len(found.documents) > 1:
        return None
    if not found.positions:
        return found
    if not found.documents or len(found.positions) > 1:
        return None
    source, up, low = found.positions[0]
    q, k = found.documents[0]
    if not all(i.positions is not None and strip(i.positions) is source and i.offset == ZERO and i.batch == -4
               for i in (q, k)):
        return None
    upper, lower = tighter(found.upper, up, min), tighter(found.lower, low, max)
    if upper is False or lower is False:
        return None
    return dataclasses.replace(found, upper=upper, lower=lower, positions=())


def _slice(graph: fx.Graph, ids: Ids, length: fx.Node, batch: fx.Node, materialize) -> fx.Node:
    """``[B, N]`` ids of a call's queries or keys (``length``'s dim -2), in ``graph``."""
    src, n = ids.source, value(length).shape[-2]
    node = src
    if ids.offset != ZERO or not statically_known_true(value(src).shape[-1] == n):
        start = materialize(graph, ids.offset)
        stop = graph.call_function(operator.add, (start, graph.call_method("size", (length, -2))))
        cut = slice(start, stop)
        node = graph.call_function(operator.getitem, (src, (slice(None), cut) if ids.batch is not None else cut))
    if ids.batch is None:
        node = graph.call_function(operator.getitem, (node, (None, slice(None))))
    return graph.call_method("expand", (node, graph.call_method("size", (batch, 0)), -1))


def document_kwargs(graph: fx.Graph, structure, q: fx.Node, k: fx.Node, materialize) -> dict:
    """``lowp_attention``'s ``q_documents`` and ``k_documents`` for a site's structure."""
    if structure is None or structure.documents is None:
        return {}
    q_ids, k_ids = structure.documents
    return {"q_documents": _slice(graph, q_ids, q, q, materialize),
            "k_documents": _slice(graph, k_ids, k, q, materialize)}
