"""The structure of attention masks, read from the graph that builds them.

Models rarely call SDPA with ``is_causal``: HF transformers builds a boolean
``[B, 1, Nq, Nk]`` mask from index arithmetic (``masking_utils``: ``kv_idx <= q_idx``,
``kv_idx > q_idx - window``, ``attention_mask[batch_idx, kv_idx]``), hand-written attention
fills ``torch.tril`` masks.  ``mask_structure`` evaluates such a graph symbolically: index
tensors are affine in the query (row) or key (column) index, comparisons of the two are
bounds on ``col - row``, a gather of a ``[B, Nk]`` tensor by (batch, column) is key padding,
and ``&`` collects them.  What it recognises becomes the op's causal structure
(``formats.visible``) and a ``[B, Nk]`` key-padding vector, so no ``Nq x Nk`` tensor is
built and the kernels skip hidden tiles; anything else stays a dense mask.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .common import MASK_FILL_MAX, Site, arg, constant_fill, node_kind, rank, value
from . import packed
from .mask_values import ZERO, Arange, Const, Delta, Fill, Ids, Index, Not, Structure, add, affine, tighter

@dataclasses.dataclass
class MaskStructure:
    """What ``mask_structure`` found: the causal structure as the op takes it (``diagonal``
    and ``window`` as ints or graph nodes, ``formats.visible``) and a key-padding vector
    (a ``[B, Nk']`` boolean node, sliced by ``pad_offset`` at replacement time), and the
    masks' own nodes (``erase_dead`` takes their producers with them once the site is
    rewritten); ``documents``: the (query, key) ``mask_values.Ids`` of a document
    structure (``packed.py``)."""

    causal: bool = False
    diagonal: tuple = ZERO
    window: int = 0
    key_padding: fx.Node | None = None
    pad_offset: tuple = ZERO
    nodes: tuple = ()
    documents: tuple | None = None


class _Evaluator:
    def __call__(self, node):
        if not isinstance(node, fx.Node):
            return Const(bool(node)) if isinstance(node, bool) else None
        return self._eval(node)

    def _eval(self, node: fx.Node):
        if node.op == "placeholder":  # a mask built outside a checkpointed body (lift_mask_structures)
            return node.meta.get(LIFTED)
        target, k = node.target, node_kind(node)
        if node.op == "call_function" and target is torch.arange:
            args = node.args
            if len(args) == 1 or (len(args) == 2 and affine(args[0]) == ZERO):
                return Arange()
            return None
        if k in ("cast", "contiguous") or (node.op == "call_method" and target in ("bool", "expand", "clone")):
            # casts and device moves of index or boolean tensors (never a float cast of an index)
            inner = self(node.args[0])
            if isinstance(inner, (Index, Arange)) and node.op == "call_method" and target in ("float", "half", "bfloat16"):
                return None
            return inner
        if k == "add" or (node.op == "call_function" and target in (operator.sub, torch.sub)) or \
                (node.op == "call_method" and target == "sub"):
            a, b = node.args[:2]
            sign = 1 if k == "add" else -1
            base, off = self(a), affine(b)
            if off is None and k == "add":
                base, off = self(b), affine(a)
            if off is None and k != "add":  # q_idx - kv_idx (flex_attention's windows)
                other = self(b)
                if isinstance(base, Index) and isinstance(other, Index) and {base.dim, other.dim} == {-1, -2}:
                    return Delta(1 if base.dim == -1 else -1, add(base.offset, other.offset, -1))
            if isinstance(base, (Index, Arange)) and off is not None:
                return dataclasses.replace(base, offset=add(base.offset, off, sign))
            if isinstance(base, Fill) and off is not None:
                return Fill(add(base.value, off, sign))
            return None
        if k == "getitem":
            return self._getitem(node)
        if node.op == "call_method" and target == "unsqueeze":
            inner, dim = self(node.args[0]), node.args[1]  # [N, 1] is the row index, [1, N] the column index
            if isinstance(inner, Arange) and dim in (0, 1, -1, -2):
                return Index(-2 if dim in (1, -1) else -1, inner.offset)
            if isinstance(inner, Ids) and isinstance(dim, int):
                return packed.place(inner, rank(node.args[0]), dim)
            return None
        if node.op == "call_method" and target in ("new_ones", "new_zeros") and arg_dtype(node) is torch.bool:
            return Const(target == "new_ones")  # and_masks' and or_masks' start
        if node.op == "call_function" and target in (operator.or_, torch.logical_or, torch.bitwise_or) or \
                (node.op == "call_method" and target in ("logical_or", "__or__")):
            return _disjoin(self(node.args[0]), self(node.args[1]))
        if node.op == "call_function" and target in (operator.invert, torch.logical_not, torch.bitwise_not) or \
                (node.op == "call_method" and target in ("logical_not", "bitwise_not", "__invert__")):
            inner = self(node.args[0])
            return _negate(inner) or (Not(inner) if isinstance(inner, Structure) else None)
        if node.op == "call_function" and target in (operator.and_, torch.logical_and, torch.bitwise_and) or \
                (node.op == "call_method" and target in ("logical_and", "__and__")):
            return _conjoin(self(node.args[0]), self(node.args[1]))
        if node.op == "call_function" and target in (operator.le, operator.lt, operator.ge, operator.gt,
                                                      torch.le, torch.lt, torch.ge, torch.gt):
            a, b = node.args[:2]
            return _compare(target, self(a), affine(b) if affine(b) is not None else self(b))
        if node.op == "call_function" and target in (torch.tril, torch.triu) or \
                (node.op == "call_method" and target in ("tril", "triu")):
            return self._triangle(node)
        return packed.evaluate(self, node)

    def _getitem(self, node: fx.Node):
        base, index = node.args
        inner = self(base)
        if isinstance(inner, Fill):  # any part of a uniform tensor
            return inner
        if isinstance(inner, Index) and inner.dim == -1 and rank(base) == 2 and isinstance(index, tuple) \
                and len(index) == 2:
            # positions [B, N], a ramp over N: pos[:, :1] is its first value, pos[batch_idx, idx] is idx's
            first, (b, i) = index[1], (self(x) if isinstance(x, fx.Node) else None for x in index)
            if index[0] == slice(None) and isinstance(first, slice) and first.start in (None, 0) and first.stop == 1:
                return Fill(inner.offset)
            if isinstance(b, Index) and b.dim == -4 and isinstance(i, Index) and i.dim in (-1, -2):
                return Index(i.dim, add(i.offset, inner.offset))
            return None
        ids = packed.getitem(self, node, inner)
        if ids is not None:
            return ids
        if isinstance(inner, Arange) and isinstance(index, tuple):
            # arange placed on one axis of a broadcast: [None, None, :, None] is the row index
            full = [i for i, x in enumerate(index) if x == slice(None)]
            if len(full) == 1 and all(x is None for i, x in enumerate(index) if i != full[0]):
                pos = full[0] - len(index)
                return Index(pos, inner.offset) if pos in (-1, -2, -4) else None
            return None
        if isinstance(inner, (Structure, Const)) and isinstance(index, tuple):
            # slicing a mask to its keys (HF eager: mask[:, :, :, :Nk]) keeps it, if from 0
            if all(isinstance(x, slice) and x.start in (None, 0) and x.step in (None, 1) or x is Ellipsis
                   for x in index):
                return inner
            return None
        if isinstance(index, tuple) and len(index) == 2 and rank(base) == 2 and value(base).dtype == torch.bool:
            b, col = (self(i) for i in index)  # keep[batch_idx, kv_idx]: key padding
            if isinstance(b, Index) and b.dim == -4 and b.offset == ZERO and isinstance(col, Index) \
                    and col.dim == -1:  # (a flex_attention mask_mod's buffer is the caller's tensor)
                return Structure(pads=((inner.node if isinstance(inner, packed.Source) else base, col.offset),))
        return None

    def _triangle(self, node: fx.Node):
        """``tril``/``triu`` of an all-ones ``[Nq, Nk]`` (or broadcast) tensor."""
        src = node.args[0]
        diag = arg(node, 1, "diagonal", 0) if len(node.args) > 1 or "diagonal" in node.kwargs else 0
        if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is torch.ones
                and isinstance(diag, int)):
            return None
        lower = node.target in (torch.tril, "tril")
        # tril(d) keeps col <= row + d; triu(d) keeps col >= row + d, i.e. col - row > d - 1
        return Structure(upper=(diag, ())) if lower else Structure(lower=(diag - 1, ()))


def arg_dtype(node: fx.Node):
    return node.kwargs.get("dtype")


def _conjoin(a, b):
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value and b.value)
    for x, y in ((a, b), (b, a)):
        if isinstance(x, Const):
            return y if x.value and isinstance(y, Structure) else None
    if isinstance(a, Structure) and isinstance(b, Structure):
        return a & b
    return None


def _disjoin(a, b):
    """``a | b`` where one side is a constant (or_masks' start); a union of structures is
    none."""
    for x, y in ((a, b), (b, a)):
        if isinstance(x, Const):
            return x if x.value else y
    return None


def _compare(target, a, b):
    """``a op b`` with one side the column index and the other the row index (or their
    difference against a constant: flex_attention's ``q_idx - kv_idx <= w``), position ids
    at those indices (``packed.compare``), or an index against a constant that holds for
    every index (BERT's bidirectional ``q_idx >= 0``)."""
    name = {operator.le: "le", torch.le: "le", operator.lt: "lt", torch.lt: "lt",
            operator.ge: "ge", torch.ge: "ge", operator.gt: "gt", torch.gt: "gt"}[target]
    return _bound(name, a, b)


def _bound(name, a, b):
    if isinstance(a, Ids) and isinstance(b, Ids):
        return packed.compare(name, a, b, _bound)
    if isinstance(a, Delta) and isinstance(b, tuple):  # +-(col - row) + off ? c
        col, row = Index(-1, a.offset if a.sign == 1 else b), Index(-2, b if a.sign == 1 else a.offset)
        return _bound(name, col, row) if a.sign == 1 else _bound(name, row, col)
    if isinstance(a, Index) and isinstance(b, tuple) and not b[1] and not a.offset[1]:
        least = b[0] - a.offset[0]  # index >= least (ge) or > least (gt) for every index >= 0
        return Const(True) if (name == "ge" and least <= 0) or (name == "gt" and least < 0) else None
    if not (isinstance(a, Index) and isinstance(b, Index)) or {a.dim, b.dim} != {-1, -2}:
        return None
    if a.dim == -2:  # write it as col ? row + d
        a, b = b, a
        name = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}[name]
    d = add(b.offset, a.offset, -1)  # col + ca ? row + cb  <=>  col - row ? cb - ca
    if name == "le":
        return Structure(upper=d)
    if name == "lt":
        return Structure(upper=add(d, (-1, ())))
    if name == "gt":
        return Structure(lower=d)
    return Structure(lower=add(d, (-1, ())))


# Placeholder meta: what a boolean mask passed into a checkpointed body computes.
LIFTED = "fp4attn_mask_structure"


def lift_mask_structures(gm: fx.GraphModule) -> None:
    """Under activation checkpointing Dynamo builds the mask once, outside the layers'
    bodies, and passes it to each ``tag_activation_checkpoint`` call, where the body's
    site sees a placeholder.  Tag each such placeholder with the structure its boolean
    operand computes (bounds known at compile time), the key-padding vector it gathers
    and the document ids it compares passed in as more operands: the body's site then
    reads the mask as if it were built there.  Bodies called from more than one place are
    left alone."""
    for call, body, placeholders in _checkpoint_calls(gm):
        for placeholder, operand in zip(placeholders, call.args[1:]):
            mask = value(operand)
            if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() >= 2):
                continue
            found = _Evaluator()(operand)
            if isinstance(found, Structure):
                found = packed.resolve(found, tighter)
            if isinstance(found, Structure):
                ids = [i for pair in found.documents for i in pair]
                if len(found.pads) > 1 or any(b is not None and b[1] for b in (found.upper, found.lower)) or \
                        any(offset[1] for _, offset in found.pads) or any(i.offset[1] for i in ids):
                    continue  # symbolic bounds: their nodes live outside the body
                found = dataclasses.replace(
                    found, pads=tuple((_pass_in(call, body, pad), offset) for pad, offset in found.pads),
                    documents=tuple(tuple(dataclasses.replace(i, source=_pass_in(call, body, i.source), positions=None)
                                          for i in pair) for pair in found.documents))
            if isinstance(found, (Structure, Const)):
                placeholder.meta[LIFTED] = found


def drop_unread_masks(gm: fx.GraphModule) -> None:
    """Once the bodies are rewritten, a mask no body reads any more is no longer passed in
    (nor built, where nothing else reads it): checkpointing would keep it alive, an
    ``N x N`` tensor, from the forward to the recomputation."""
    for call, body, placeholders in _checkpoint_calls(gm):
        unread = [i for i, p in enumerate(placeholders) if LIFTED in p.meta and not p.users]
        if not unread:
            continue
        dropped = [call.args[1 + i] for i in unread]
        call.args = (call.args[0], *(a for i, a in enumerate(call.args[1:]) if i not in unread))
        for i in unread:
            body.graph.erase_node(placeholders[i])
        body.recompile()
        erase_dead(dropped)


def _checkpoint_calls(gm: fx.GraphModule):
    """(call, body, its placeholders) for each ``tag_activation_checkpoint`` call of ``gm``
    whose body no other call shares and takes the call's operands one placeholder each."""
    for call in list(gm.graph.nodes):
        if call.op != "call_function" or call.target is not torch.ops.higher_order.tag_activation_checkpoint:
            continue
        body_attr = call.args[0]
        if body_attr.op != "get_attr" or len(body_attr.users) != 1:
            continue
        body = getattr(gm, body_attr.target)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if len(placeholders) == len(call.args) - 1:
            yield call, body, placeholders


def _pass_in(call: fx.Node, body: fx.GraphModule, node: fx.Node) -> fx.Node:
    """``node`` of the calling graph as a placeholder of ``body``: the one it already
    reaches, or a new last operand."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for placeholder, operand in zip(placeholders, call.args[1:]):
        if operand is node:
            return placeholder
    with body.graph.inserting_after(placeholders[-1]):
        new = body.graph.placeholder(f"{node.name}_lifted")
    new.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "tensor_meta")})
    call.args = (*call.args, node)
    return new


def mask_structure(node, keep: bool = True) -> MaskStructure | None:
    """The structure of a boolean mask node (True keeps, or with ``keep=False`` True
    drops), None where it is not recognised whole.  Recognised: conjunctions of causal
    bounds (``tril``/``triu`` of ones, index comparisons with any offsets, a sliding
    window), key padding gathered by (batch, key) and one document structure
    (``packed.py``)."""
    ev = _Evaluator()
    found = ev(node)
    if not keep:
        found = _negate(found)
    if isinstance(found, Const):
        return MaskStructure(nodes=(node,)) if found.value else None
    if isinstance(found, Structure):
        found = packed.resolve(found, tighter)
    if not isinstance(found, Structure) or len(found.pads) > 1:
        return None
    if found.lower is not None and found.upper is None:
        return None  # keys only bounded below: not a causal structure
    window = 0
    if found.lower is not None:
        span = add(found.upper, found.lower, -1)
        if span[1] or span[0] <= 0:
            return None
        window = span[0]
    pad, pad_offset = found.pads[0] if found.pads else (None, ZERO)
    return MaskStructure(causal=found.upper is not None, diagonal=found.upper or ZERO, window=window,
                         key_padding=pad, pad_offset=pad_offset, nodes=(node,),
                         documents=found.documents[0] if found.documents else None)


def _negate(found):
    """The complement of a single bound (a drop mask such as ``triu(ones, 1)``) or of a
    complement."""
    if isinstance(found, Not):
        return found.inner
    if isinstance(found, Const):
        return Const(not found.value)
    if isinstance(found, Structure) and not (found.pads or found.documents or found.positions) and \
            (found.upper is None) != (found.lower is None):
        if found.upper is not None:  # not (col - row <= u)  ==  col - row > u
            return Structure(lower=found.upper)
        return Structure(upper=found.lower)  # not (col - row > l)  ==  col - row <= l
    return None


def materialize(graph: fx.Graph, offset: tuple):
    """An affine offset as an int or a node computing it (inserted at the graph's
    current insertion point)."""
    const, terms = offset
    result = const
    for node, c in terms:
        term = node if c == 1 else graph.call_function(operator.mul, (node, c))
        result = term if isinstance(result, int) and result == 0 else graph.call_function(operator.add,
                                                                                         (result, term))
    return result


# Ops that build masks and nothing else: once the rewrite drops a mask, those of its
# producers left without users are erased (never an op with effects, such as a cache update).
_PURE_METHODS = {"to", "bool", "expand", "contiguous", "clone", "new_ones", "unsqueeze", "tril", "triu",
                 "float", "half", "bfloat16", "sub", "add", "__and__", "logical_and", "logical_not", "bitwise_not",
                 "__invert__", "new_zeros", "__or__", "logical_or", "eq", "ne", "__eq__", "__ne__", "cumsum"}
_PURE_FUNCTIONS = {torch.arange, torch.ones, torch.zeros, torch.tril, torch.triu, torch.where, operator.getitem, operator.add,
                   operator.sub, operator.and_, operator.le, operator.lt, operator.ge, operator.gt, torch.le, torch.lt,
                   torch.ge, torch.gt, torch.logical_and, torch.bitwise_and, torch.sub, torch.add, operator.invert,
                   torch.logical_not, torch.bitwise_not, operator.or_, torch.logical_or, torch.bitwise_or, operator.eq,
                   operator.ne, torch.eq, torch.ne, torch.diff, torch.cumsum}


def erase_dead(nodes) -> None:
    """Erase the mask-building nodes among ``nodes`` (and their producers) that no longer
    have users."""
    pending, erased = list(nodes), set()
    while pending:
        node = pending.pop()
        # _erased: another site sharing the mask erased it already
        if node in erased or node._erased or node.users or node.op not in ("call_function", "call_method"):
            continue
        pure = node.target in _PURE_METHODS if node.op == "call_method" else _hashable_in(node.target,
                                                                                        _PURE_FUNCTIONS)
        if not pure:
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)


def _hashable_in(target, group) -> bool:
    try:
        return target in group
    except TypeError:
        return False


def _where_fill(node) -> tuple | None:
    """``where(cond, 0, fill)`` (keep where cond) or ``where(cond, fill, 0)`` (drop) with a
    constant fill at or below ``MASK_FILL_MAX``: (cond, keep, fill), else None.  HF's eager
    attention adds such a mask (fill finfo.min)."""
    if node_kind(node) != "where":
        return None
    cond, a, b = (arg(node, i) for i in range(3))
    fa, fb = _fill_value(a), _fill_value(b)
    if fa == 0.0 and fb is not None and fb <= MASK_FILL_MAX:
        return cond, True, fb
    if fb == 0.0 and fa is not None and fa <= MASK_FILL_MAX:
        return cond, False, fa
    return None


def _fill_value(x) -> float | None:
    if isinstance(x, fx.Node) and x.op == "call_function" and x.target is torch.zeros:
        return 0.0
    return constant_fill(x)


def structure_site(site: Site) -> None:
    """Read the structure of a site's masks: each mask whose structure is recognised
    leaves the site's dense masks and joins its causal structure and key padding (one
    causal bound and one key-padding vector at most); ``site.empty_rows`` records what a
    query row with no visible key gets where the site was written (``attention.EMPTY_ROWS``)."""
    parts, fills, runtime = [], [], False
    if site.attn_mask is not None:  # SDPA: boolean (True keeps) or additive
        mask = site.attn_mask
        found = None
        if value(mask).dtype == torch.bool:
            found, fill = mask_structure(mask), None
        elif (where := _where_fill(mask)) is not None:
            found, fill = mask_structure(where[0], keep=where[1]), where[2]
            found = found and dataclasses.replace(found, nodes=(*found.nodes, mask))
        if found is not None:
            parts.append(found)
            site.attn_mask = None
            fills.append(fill)
        elif value(mask).dtype != torch.bool:
            runtime = True
    for masks, keep in ((site.keep_masks, True), (site.drop_masks, False)):
        for mask, fill in list(masks):
            found = mask_structure(mask, keep=keep)
            if found is not None:
                parts.append(found)
                masks.remove((mask, fill))
            fills.append(fill)
    for term in list(site.bias_terms):
        mask, factors = term
        where = _where_fill(mask) if not factors else None
        found = mask_structure(where[0], keep=where[1]) if where is not None else None
        if found is None:
            runtime = True
            continue
        parts.append(dataclasses.replace(found, nodes=(*found.nodes, mask)))
        site.bias_terms.remove(term)
        fills.append(where[2])
    site.empty_rows = _empty_rows(site.kind, fills, runtime)
    combined = _combine(parts, site.causal) if parts else None
    if combined is None:
        return  # masks stay dense (none recognised, or their structure did not combine)
    site.structure = combined
    site.causal = site.causal or combined.causal


def _combine(parts: list, causal: bool) -> MaskStructure | None:
    bounded = [p for p in parts if p.causal]
    padded = [p for p in parts if p.key_padding is not None]
    packs = [p for p in parts if p.documents is not None]
    if len(bounded) + causal > 1 or len(padded) > 1 or len(packs) > 1:
        return None
    out = MaskStructure(nodes=tuple(n for p in parts for n in p.nodes))
    if bounded:
        out = dataclasses.replace(out, causal=True, diagonal=bounded[0].diagonal, window=bounded[0].window)
    if padded:
        out = dataclasses.replace(out, key_padding=padded[0].key_padding, pad_offset=padded[0].pad_offset)
    if packs:
        out = dataclasses.replace(out, documents=packs[0].documents)
    return out


def _empty_rows(site_kind: str, fills: list, runtime: bool) -> str:
    """SDPA gives an empty row zeros for boolean and -inf masks (its safe softmax) and the
    mean of V for a finite fill; a hand-written softmax gives NaN for -inf fills and the
    mean of V for finite ones.  Additive masks whose values only the run shows decide per
    row at run time."""
    if runtime:
        return "sdpa" if site_kind == "sdpa" else "softmax"
    finite = [f for f in fills if f is not None and f != float("-inf")]
    if finite:
        return "mean"
    if site_kind == "sdpa" or not fills:
        return "zero"
    return "nan"
