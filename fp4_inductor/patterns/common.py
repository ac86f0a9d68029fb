"""FX helpers shared by the matchers: what a Dynamo-graph node computes, its arguments
whatever the spelling (function, method or operator), and the site description."""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn.functional as nnf

if TYPE_CHECKING:  # masks.py imports this module
    from .masks import MaskStructure

# Dynamo graphs spell one operation several ways; matchers ask for the canonical kind.
_FUNCTION_KINDS = {
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    torch.bmm: "bmm",
    torch.baddbmm: "baddbmm",
    torch.einsum: "einsum",
    torch.functional.einsum: "einsum",
    torch.softmax: "softmax",
    nnf.softmax: "softmax",
    torch.transpose: "transpose",
    torch.permute: "permute",
    operator.mul: "mul",
    operator.imul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    operator.itruediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    operator.add: "add",
    operator.iadd: "add",
    torch.add: "add",
    nnf.dropout: "dropout",
    torch.dropout: "dropout",
    torch.where: "where",
    torch.masked_fill: "masked_fill",
    nnf.scaled_dot_product_attention: "sdpa",
    # aten-level graphs (exported programs, or aten calls in user code): Dynamo's graphs
    # call the packet, exported ones the overload
    torch.ops.aten.scaled_dot_product_attention: "sdpa",
    torch.ops.aten.scaled_dot_product_attention.default: "sdpa",
    torch.repeat_interleave: "repeat_interleave",
    torch.reshape: "reshape",
    operator.getitem: "getitem",
    torch.full: "full",
    torch.tensor: "tensor",
    torch.scalar_tensor: "tensor",
}
if hasattr(torch.ops.higher_order, "flex_attention"):  # erase_replaced takes a replaced call away
    _FUNCTION_KINDS[torch.ops.higher_order.flex_attention] = "flex"
# SDPA's backend ops in aten-level graphs, with where (dropout_p, is_causal, scale,
# attn_mask) sit among their arguments; only their output (element 0) may be used.
SDPA_BACKENDS = {
    torch.ops.aten._scaled_dot_product_flash_attention: (3, 4, 6, None),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (3, 4, 6, 5),
    torch.ops.aten._scaled_dot_product_efficient_attention: (5, 6, 7, 3),
    torch.ops.aten._scaled_dot_product_cudnn_attention: (6, 7, 9, 3),
}
SDPA_BACKENDS.update({packet.default: where for packet, where in SDPA_BACKENDS.items()})
_FUNCTION_KINDS.update({op: "sdpa_backend" for op in SDPA_BACKENDS})
_METHOD_KINDS = {
    "matmul": "matmul",
    "bmm": "bmm",
    "baddbmm": "baddbmm",
    "softmax": "softmax",
    "transpose": "transpose",
    "permute": "permute",
    "mul": "mul",
    "mul_": "mul",
    "div": "div",
    "div_": "div",
    "add": "add",
    "add_": "add",
    "masked_fill": "masked_fill",
    "expand": "expand",
    "reshape": "reshape",
    "view": "reshape",
    "repeat_interleave": "repeat_interleave",
    "to": "cast",
    "float": "cast",
    "half": "cast",
    "bfloat16": "cast",
    "type_as": "cast",
    "type": "cast",
    "contiguous": "contiguous",
}
# Positional parameter names, for reading arguments however they were passed.
_SIGNATURES = {
    "softmax": ("input", "dim", "_stacklevel", "dtype"),
    "dropout": ("input", "p", "training", "inplace"),
    "transpose": ("input", "dim0", "dim1"),
    "baddbmm": ("input", "batch1", "batch2"),
    "sdpa": ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    "where": ("condition", "input", "other"),
    "masked_fill": ("input", "mask", "value"),
    "repeat_interleave": ("input", "repeats", "dim"),
    "full": ("size", "fill_value"),
    "tensor": ("data",),
}


def node_kind(node) -> str | None:
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        try:
            return _FUNCTION_KINDS.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return _METHOD_KINDS.get(node.target)
    return None


def arg(node: fx.Node, index: int, name: str | None = None, default=None):
    """Argument ``index`` (or keyword ``name``) of a call, by the kind's signature."""
    if name is None:
        name = _SIGNATURES[node_kind(node)][index]
    if name in node.kwargs:
        return node.kwargs[name]
    if index < len(node.args):
        return node.args[index]
    return default


def value(node) -> torch.Tensor | None:
    """The example (fake) value Dynamo recorded for a node."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return None


def rank(node) -> int | None:
    v = value(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def swaps_last_two(node: fx.Node) -> fx.Node | None:
    """The input of ``x.transpose(-2, -1)`` (any spelling, permute and ``.mT`` included), else None.

    Only an exact swap of the last two dimensions qualifies: a permuted K that is not
    this swap is not ``K^T`` (pytorch issue 195320) and the site must stay as written.
    """
    r = rank(node)
    if r is None or r < 2:
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("mT",):
        return node.args[0]
    k = node_kind(node)
    if k == "transpose":
        dims = sorted(int(d) % r for d in (arg(node, 1), arg(node, 2)))
        return node.args[0] if dims == [r - 2, r - 1] else None
    if k == "permute":
        dims = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
        dims = [int(d) % r for d in dims]
        return node.args[0] if dims == [*range(r - 2), r - 1, r - 2] else None
    return None


def constant_fill(node) -> float | None:
    """A numeric fill value: a literal, or ``torch.full([], c)`` / ``torch.tensor(c)``."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    k = node_kind(node)
    if k == "full" and isinstance(arg(node, 1), (int, float)):
        return float(arg(node, 1))
    if k == "tensor" and isinstance(arg(node, 0), (int, float)):
        return float(arg(node, 0))
    return None


def module_path(node: fx.Node) -> str:
    """``layers.0.self_attn`` for the module the node was traced in ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo names the root by how it was reached: L['self'], L['args'][0], G['model'] ...
    path = re.sub(r"^[LG]\['[^']*'\](\[\d+\])?", "", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    path = re.sub(r"^(\.?_modules\.|\.)", "", path)
    # diffusers' blocks reach Dynamo through an instance __dict__ (transformer_blocks.0.attn)
    path = path.replace("._modules.", ".").replace("__dict__.", "").replace(".__dict__", "")
    return path.strip(".")


# masked_fill / where fills at or below this are treated as "masked out".
MASK_FILL_MAX = -1e4


@dataclasses.dataclass
class Site:
    """One attention found in a graph, and what to call in its place.

    ``q``/``k``/``v`` are ``[..., N, D]`` nodes (k not transposed); ``scale`` is a
    float, a node, or None for SDPA's default; ``bias_terms`` are ``(mask, factor)``
    additive masks; ``keep_masks``/``drop_masks`` ``(mask, fill)`` boolean masks (True
    keeps / drops) and the value the site fills masked scores with.  ``structure``: the
    causal structure and key padding read from masks (``masks.structure_site``; those
    masks are no longer among the dense ones), ``causal`` whether there is one;
    ``empty_rows`` what a query row with no visible key gets (``attention.EMPTY_ROWS``).
    ``unsupported`` says why the site must stay as written.  Sites inside one fused module
    call (``nn.MultiheadAttention``, PyTorch's inference fast paths) keep their masks as
    that call's arguments (``call_masks``) and are replaced by a run-time function of the
    same arguments (``rewrite``); the others by an attention call on q, k, v
    (``patterns.attention_call``).
    """

    kind: str
    anchor: fx.Node
    q: fx.Node | None = None
    k: fx.Node | None = None
    v: fx.Node | None = None
    scale: object = None
    causal: bool = False
    attn_mask: fx.Node | None = None
    bias_terms: list = dataclasses.field(default_factory=list)
    keep_masks: list = dataclasses.field(default_factory=list)
    drop_masks: list = dataclasses.field(default_factory=list)
    unsupported: str | None = None
    name: str = ""
    # Set by matchers whose q/k/v are not [..., N, D] head tensors (nn.MultiheadAttention).
    dims: tuple | None = None
    weights: tuple = ()  # parameters the site multiplies by, for "does it train?"
    structure: MaskStructure | None = None
    empty_rows: str = "zero"
    mask_note: str | None = None  # mask_kind() of a site whose masks are call arguments (MHA)
    call_masks: tuple | None = None  # the fused call's own mask arguments (None where absent)
    # (graph, site, attention, options) -> the node computing the site, inserted before the
    # anchor; ``attention`` is ``lowp_attention`` or a stand-in with its signature (tuning's
    # probe), ``options`` its keyword arguments (fmt, p_mode, min_keys, backward).
    rewrite: Callable | None = None

    def dense_masks(self) -> list:
        """The masks read as tensors (None where absent): what ``structure`` did not take."""
        return [self.attn_mask, *(m for m, _ in (*self.keep_masks, *self.drop_masks, *self.bias_terms))]

    def mask_nodes(self, dense: bool = False) -> list:
        """The site's masks (None where absent); with ``dense``, only those read per score
        (not the key-padding vector its structure holds)."""
        if self.call_masks is not None:
            return list(self.call_masks)
        pad = self.structure.key_padding if self.structure is not None and not dense else None
        return [pad, *self.dense_masks()]

    def mask_kind(self) -> str:
        """What masks the site has, as ``explain`` shows them and the cost table keys them:
        "none", "causal", "causal+offset", "window W", each "+documents" where document ids
        join (packed sequences), "+padding" where a key-padding vector does, or "dense"
        where a mask tensor is read per score."""
        if self.mask_note is not None:
            return self.mask_note
        s = self.structure
        parts = []
        if self.causal:
            offset = s is not None and s.diagonal != (0, ())
            parts.append(f"window {s.window}" if s is not None and s.window else
                         "causal+offset" if offset else "causal")
        if s is not None and s.documents is not None:
            parts.append("documents")
        if s is not None and s.key_padding is not None:
            parts.append("padding")
        dense = [m for m in self.dense_masks() if m is not None]
        if dense:
            parts.append("padding" if all(_key_row(m, self) for m in dense) else "dense")
        return "+".join(dict.fromkeys(parts)) or "none"

    def training(self) -> bool:
        """Whether the site's graph will be differentiated.  Dynamo hands a graph to the
        backend under the grad mode it was traced in: under ``no_grad`` a module's weights
        still require grad, but nothing is trained."""
        return torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (value(n) for n in (self.q, self.k, self.v, *self.weights)))

    def graph_dims(self) -> tuple | None:
        """(B, H, Hkv, Nq, Nkv, D) as the graph has them: ints, or SymInts under dynamic shapes."""
        if self.dims is not None:
            return self.dims
        qv, kv = value(self.q), value(self.k)
        if not isinstance(qv, torch.Tensor) or not isinstance(kv, torch.Tensor):
            return None
        if qv.dim() == 3:
            return (qv.shape[0], 1, 1, qv.shape[1], kv.shape[1], qv.shape[2])
        if qv.dim() == 4:
            return (qv.shape[0], qv.shape[1], kv.shape[1], qv.shape[2], kv.shape[2], qv.shape[3])
        return None

    def key_length(self):
        return self.graph_dims()[4]

    def query_length(self):
        return self.graph_dims()[3]

    def shape(self) -> tuple | None:
        """``graph_dims`` as ints (size hints where symbolic)."""
        dims = self.graph_dims()
        return None if dims is None else tuple(_hint(d) for d in dims)


def _hint(d) -> int:
    if isinstance(d, torch.SymInt):
        return d.node.hint if d.node.hint is not None else d.node.shape_env.size_hint(d.node.expr)
    return int(d)


def _key_row(mask, site: Site) -> bool:
    """Whether a dense mask is one row per sequence (``[B, 1, 1, Nk]``, as BERT's key
    padding): the kernels read it as a bias row, not per score."""
    m, q = value(mask), value(site.q)
    if not isinstance(m, torch.Tensor) or not isinstance(q, torch.Tensor):
        return False
    return m.dim() < 2 or (m.shape[-2] == 1 and all(n == 1 for n in m.shape[-m.dim():-2][1:]))


def strip_repeat_kv(site: Site) -> None:
    """Use the un-repeated K/V when both come from the same ``repeat_kv`` expansion:
    the op reads shared heads in place (GQA) instead of copies."""
    k, k_rep = _unrepeat(site.k)
    v, v_rep = _unrepeat(site.v)
    if k_rep == v_rep > 1:
        site.k, site.v = k, v


def _unrepeat(node) -> tuple:
    k = node_kind(node)
    if k == "repeat_interleave":
        reps, dim = arg(node, 1), arg(node, 2)
        if isinstance(reps, int) and dim in (1, -3) and rank(node) == 4:
            return node.args[0], reps
    if k == "reshape":
        expand = node.args[0]
        if node_kind(expand) == "expand" and node_kind(expand.args[0]) == "getitem":
            getitem = expand.args[0]
            base, index = getitem.args
            full = slice(None)
            if (
                rank(base) == 4
                and isinstance(index, tuple)
                and len(index) == 5
                and index[2] is None
                and all(i == full for j, i in enumerate(index) if j != 2)
            ):
                heads, out_heads = value(base).shape[1], value(node).shape[1]
                if out_heads % heads == 0:
                    return base, out_heads // heads
    return node, 1
