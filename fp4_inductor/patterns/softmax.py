"""Hand-written softmax attention in the Dynamo graph, anchored at the softmax node.

Recognised: ``softmax(mask_ops(scale_ops(Q @ K^T)), dim=-1) [cast] [no-op dropout] @ V``
with ``matmul``/``@``/``bmm``/``baddbmm``/``einsum``, scales by ``*`` or ``/`` (python
numbers, SymFloats or 0-d tensors; a pre-scaled Q needs none), additive masks,
``masked_fill`` and ``torch.where`` masks, and ``repeat_kv``-style GQA on K and V.
Anything else that still looks like attention becomes a site with a reason to stay as
written: probabilities used elsewhere, softmax over another dimension, a K operand that
is not ``transpose(-2, -1)``, dropout in training.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .common import MASK_FILL_MAX, Site, arg, constant_fill, node_kind, module_path, rank, strip_repeat_kv, swaps_last_two, value
from .masks import structure_site


@dataclasses.dataclass
class _Scores:
    q: fx.Node
    k: fx.Node | None
    # From the QK product towards softmax: ("scale", factor, is_div) | ("add", mask)
    # | ("keep", bool_mask, fill) | ("drop", bool_mask, fill)
    ops: list
    unsupported: str | None = None


def softmax_over_other_dim(graph: fx.Graph) -> bool:
    """Whether any softmax in the graph is over another dimension than the last (or one
    not known when the graph is compiled)."""
    return any(node_kind(node) == "softmax" and not _over_last_dim(node) for node in graph.nodes)


def _over_last_dim(softmax: fx.Node) -> bool:
    r, dim = rank(softmax), arg(softmax, 1)
    return isinstance(dim, int) and isinstance(r, int) and dim % r == r - 1


def match_softmax(node: fx.Node) -> Site | None:
    if node_kind(node) != "softmax":
        return None
    scores = _trace_scores(arg(node, 0))
    if scores is None:
        return None
    pv, problem = _find_pv(node)
    if pv is None and problem is None:
        return None
    site = Site("softmax", pv if pv is not None else node, name=module_path(node))
    site.q, site.k = scores.q, scores.k
    if pv is not None:
        site.v = _pv_value_operand(pv)
    site.unsupported = (
        problem
        or scores.unsupported
        or (None if _over_last_dim(node) else "softmax is not over the last (key) dimension")
    )
    if site.unsupported is None:
        _fill_masks_and_scale(site, scores.ops)
        strip_repeat_kv(site)
        structure_site(site)
    return site


def _trace_scores(node) -> _Scores | None:
    """Walk from the softmax input back to the QK product, collecting scale/mask ops."""
    ops = []
    cur = node
    while True:
        if len(cur.users) != 1:
            return _Scores(None, None, [], "attention scores are used elsewhere") if _reaches_qk(cur) else None
        k = node_kind(cur)
        if k in ("cast", "contiguous"):
            cur = cur.args[0]
        elif k in ("mul", "div"):
            chain, factor = _scalar_operands(cur, allow_left=(k == "mul"))
            if chain is None:
                return None
            ops.append(("scale", factor, k == "div"))
            cur = chain
        elif k == "add":
            chain, mask = _tensor_operands(cur)
            if chain is None or arg(cur, 2, "alpha", 1) != 1:
                return None
            ops.append(("add", mask))
            cur = chain
        elif k == "masked_fill":
            if not _is_mask_fill(arg(cur, 2)):
                return None
            ops.append(("drop", arg(cur, 1), constant_fill(arg(cur, 2))))
            cur = cur.args[0]
        elif k == "where":
            cond, a, b = (arg(cur, i) for i in range(3))
            if _is_mask_fill(b) and isinstance(a, fx.Node):
                ops.append(("keep", cond, constant_fill(b)))
                cur = a
            elif _is_mask_fill(a) and isinstance(b, fx.Node):
                ops.append(("drop", cond, constant_fill(a)))
                cur = b
            else:
                return None
        else:
            qk = _qk_operands(cur, ops)
            if qk is None:
                return None
            ops.reverse()
            return qk


def _reaches_qk(node, depth: int = 8) -> bool:
    """Whether a matrix product lies a few elementwise steps upstream (scores, not a mask)."""
    if not isinstance(node, fx.Node) or depth == 0:
        return False
    if node_kind(node) in ("matmul", "bmm", "baddbmm", "einsum"):
        return True
    if node_kind(node) not in ("cast", "contiguous", "mul", "div", "add", "masked_fill", "where"):
        return False
    return any(_reaches_qk(a, depth - 1) for a in node.args if isinstance(a, fx.Node))


def _qk_operands(node: fx.Node, ops: list) -> _Scores | None:
    k = node_kind(node)
    if k in ("matmul", "bmm"):
        a, b = node.args[:2]
    elif k == "baddbmm":
        a, b = arg(node, 1), arg(node, 2)
        beta, alpha = arg(node, 3, "beta", 1), arg(node, 4, "alpha", 1)
        if beta not in (0, 1):
            return None
        if beta == 1:
            ops.append(("add", arg(node, 0)))
        if alpha != 1:
            ops.append(("scale", alpha, False))
    elif k == "einsum":
        parsed = _einsum_operands(node, "qk")
        return _Scores(parsed[0], parsed[1], ops) if parsed else None
    else:
        return None
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    key = swaps_last_two(b)
    if key is None:
        return _Scores(a, None, ops, "key operand is not K.transpose(-2, -1)")
    return _Scores(a, key, ops)


def _find_pv(softmax: fx.Node) -> tuple[fx.Node | None, str | None]:
    """The P @ V node fed by the softmax through casts and no-op dropout."""
    cur = softmax
    while True:
        users = list(cur.users)
        if len(users) != 1:
            used_for_pv = any(_is_pv(u, cur) for u in users)
            return None, ("attention probabilities are used elsewhere" if used_for_pv or len(users) > 1 else None)
        user = users[0]
        k = node_kind(user)
        if k in ("cast", "contiguous"):
            cur = user
        elif k == "dropout":
            p, training = arg(user, 1, default=0.5), arg(user, 2, default=True)
            if p != 0 and training is not False:
                return None, "dropout in training (not implemented in low precision)"
            cur = user
        elif _is_pv(user, cur):
            return user, None
        else:
            return None, None


def _is_pv(node: fx.Node, probs: fx.Node) -> bool:
    k = node_kind(node)
    if k in ("matmul", "bmm"):
        return node.args[0] is probs
    if k == "einsum":
        parsed = _einsum_operands(node, "pv")
        return parsed is not None and parsed[0] is probs
    return False


def _pv_value_operand(node: fx.Node) -> fx.Node:
    return _einsum_operands(node, "pv")[1] if node_kind(node) == "einsum" else node.args[1]


def _einsum_operands(node: fx.Node, which: str) -> tuple | None:
    """Operands of ``...qd,...kd->...qk`` (which="qk") or ``...qk,...kd->...qd``."""
    if not node.args or not isinstance(node.args[0], str):
        return None
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    equation = node.args[0].replace(" ", "")
    if "->" not in equation or len(operands) != 2:
        return None
    lhs, out = equation.split("->")
    parts = lhs.split(",")
    if len(parts) != 2:
        return None
    a, b, o = (_tokens(p) for p in (*parts, out))
    if not (len(a) == len(b) == len(o) >= 3 and a[:-2] == b[:-2] == o[:-2]):
        return None
    if which == "qk":
        ok = a[-1] == b[-1] and o[-2:] == [a[-2], b[-2]] and a[-2] != b[-2] and a[-1] not in o
    else:
        ok = a[-1] == b[-2] and o[-2:] == [a[-2], b[-1]] and a[-1] not in o
    return tuple(operands) if ok else None


def _tokens(spec: str) -> list[str]:
    spec = spec.replace("...", ".")
    return list(spec)


def _scalar_operands(node: fx.Node, allow_left: bool):
    a, b = node.args[:2]
    if _is_scalar(b) and isinstance(a, fx.Node) and not _is_scalar(a):
        return a, b
    if allow_left and _is_scalar(a) and isinstance(b, fx.Node) and not _is_scalar(b):
        return b, a
    return None, None


def _is_scalar(x) -> bool:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    val = value(x)
    if isinstance(val, (torch.SymInt, torch.SymFloat, int, float)):
        return True
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _tensor_operands(node: fx.Node):
    a, b = node.args[:2]
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None, None
    for chain, mask in ((a, b), (b, a)):
        if _reaches_qk(chain):
            return chain, mask
    return None, None


def _is_mask_fill(x) -> bool:
    fill = constant_fill(x)
    return fill is not None and fill <= MASK_FILL_MAX


def _fill_masks_and_scale(site: Site, ops: list) -> None:
    """Turn the op list into one softmax scale and masks scaled as the graph scaled them."""
    factors = []  # scale factors applied after the op being looked at
    for op in reversed(ops):
        if op[0] == "scale":
            factors.append(op[1:])
        elif op[0] == "add":
            site.bias_terms.append((op[1], tuple(factors)))
        elif op[0] == "keep":
            site.keep_masks.append(op[1:])
        else:
            site.drop_masks.append(op[1:])
    site.scale = tuple(factors)
