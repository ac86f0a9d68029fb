"""Attention without ``torch.compile``: ``fp4_inductor.scaled_dot_product_attention`` and
``fp4_inductor.patch()``.

The backend decides once per site of a compiled graph; here each call is a site, decided
by the same ``policy.decide`` from its tensors (so ``configure``, FP4ATTN_*, overrides and
``tune``'s decisions apply) and cached by the call's signature: a repeated call costs a
dictionary lookup.  The low-precision path is ``attention.lowp_attention``, where the
quantization of Q, K and V is always a pass of its own (a compiled graph can fuse it into
their producers).  Inside a compiled model the function is a single opaque call to Dynamo
(``allow_in_graph``): no graph break, the decision is made while AOTAutograd traces the
graph, and the ``fp4attn`` ops it calls are opaque to Inductor.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
import torch.fx as fx
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch._subclasses.fake_tensor import is_fake

from . import config
from . import formats
from .attention import lowp_attention
from .compiler import SiteRecord, _record, _tuned_decisions
from .patterns.masks import MaskStructure
from .patterns.sdpa import match_sdpa
from .policy import Decision, decide

# The function patch() replaces: every fallback calls it, never the patched name.
_SDPA = torch.nn.functional.scaled_dot_product_attention

logger = logging.getLogger(__name__)

# One decision per call signature (shapes, dtypes, devices, grad state, options); bounded,
# as a model has few signatures and a serving loop's varying lengths must not grow it forever.
_DECISIONS: dict = {}
_MAX_DECISIONS = 4096
_recorders: list[list[SiteRecord]] = []  # explain(eager=True): every call while it runs
_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_inside = [0]  # depth of attention() calls: an SDPA call made from inside one is a fallback's


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` with fp4_inductor's policy:
    the same signature and semantics (autograd included), in low precision where the
    policy takes it for this call (``policy="always"`` on a CPU runs the reference
    emulation), else SDPA itself.  ``fp4_inductor.explain(model, *args, eager=True)``
    shows each call's path and reason; the logger ``fp4_inductor.eager`` logs each new
    decision at DEBUG level."""
    if _inside[0]:  # patch() routes the fallback's own SDPA call here
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if isinstance(attn_mask, CausalBias):
        # torch.nn.attention.bias's causal mask is a structure, not values to read: SDPA's
        # is_causal (upper left) or the causal bound at diagonal Nk - Nq (lower right)
        if is_causal:
            raise ValueError("CausalBias should not be used with causal=True")
        lower_right = attn_mask.variant == CausalVariant.LOWER_RIGHT
        return attention(query, key, value, None, dropout_p, True, scale, enable_gqa,
                         diagonal=attn_mask.seq_len_kv - attn_mask.seq_len_q if lower_right else 0)
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@torch.compiler.allow_in_graph
def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              diagonal=0, window=0, key_padding=None, name=""):
    """SDPA's arguments, plus the causal structure and key padding that the integrations
    read from a framework's mask (``lowp_attention``'s ``diagonal``, ``window`` and
    ``key_padding``, in place of ``attn_mask``: no N x N tensor), and the site's name
    (which ``overrides`` match; ``module_name``)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # SDPA is on autocast's lower-precision list: what autocast gives it (every floating
        # tensor but a float64 one in the autocast dtype), then no autocast inside.
        dtype = torch.get_autocast_dtype(device)
        cast = lambda t: t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t  # noqa: E731
        with torch.autocast(device, enabled=False):
            return attention(*map(cast, (query, key, value, attn_mask)), dropout_p, is_causal, scale, enable_gqa,
                             diagonal=diagonal, window=window, key_padding=key_padding, name=name)
    structured = bool(diagonal or window) or key_padding is not None
    if structured and attn_mask is not None:
        raise ValueError("pass either attn_mask or a causal structure and key padding, not both")
    q, k, v = query, key, value
    site, decision = _decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, diagonal, window,
                             key_padding, name, structured)
    _inside[0] += 1
    try:
        if decision.low_precision:
            return lowp_attention(q, k, v, attn_mask, scale, is_causal, **config.path_arguments(decision.path),
                                  p_mode=config.current().p_mode_for(decision.path), min_keys=decision.min_keys,
                                  diagonal=diagonal, window=window, key_padding=key_padding,
                                  empty_rows=site.empty_rows)
        if structured:
            return _structured_sdpa(q, k, v, dropout_p, is_causal, scale, diagonal, window, key_padding)
        return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    finally:
        _inside[0] -= 1


def _decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, diagonal, window, key_padding, name,
            structured):
    options = config.current()
    tracing = is_fake(q)  # under torch.compile: symbolic sizes, decided once per graph
    key = None
    if not tracing:
        key = (options, torch.is_grad_enabled(), name, dropout_p, is_causal,
               scale if isinstance(scale, (int, float, type(None))) else type(scale), enable_gqa, diagonal, window,
               *(_tensor_key(t) for t in (q, k, v, attn_mask, key_padding)))
        cached = _DECISIONS.get(key)
        if cached is not None:
            _report(*cached)
            return cached
    site = _site(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, diagonal, window, key_padding,
                 name, structured)
    decision = decide(site, options, _tuned_decisions(site) if options.policy == "auto" else {})
    logger.debug("fp4attn %s %s: %s (%s)%s", name or "<call>", site.shape(), decision.path,
                 decision.reason, " while compiling" if tracing else "")
    if key is not None:
        if len(_DECISIONS) >= _MAX_DECISIONS:
            _DECISIONS.clear()
        _DECISIONS[key] = (site, decision)
    _report(site, decision)
    return site, decision


def module_name(module: torch.nn.Module) -> str:
    """The path of ``module`` in the model ``explain(eager=True)`` runs ('' elsewhere)."""
    return _names.get(module, "")


def _tensor_key(t):
    if t is None:
        return None
    return tuple(t.shape), t.dtype, t.device, t.requires_grad


def _report(site, decision: Decision) -> None:
    for records in _recorders:
        records.append(_record(site, decision, decision.low_precision))


def _site(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, diagonal, window, key_padding, name,
          structured):
    """The call as the backend's matchers see an SDPA call in a graph (``match_sdpa``): a
    one-node graph whose inputs carry the tensors as their values, so that ``policy``
    checks and prices it exactly as it would a compiled site."""
    graph = fx.Graph()

    def placeholder(label, tensor):
        if tensor is None:
            return None
        node = graph.placeholder(label)
        node.meta["val"] = tensor
        return node

    q_node, k_node, v_node, mask_node, pad_node = (
        placeholder(label, t) for label, t in
        zip(("query", "key", "value", "attn_mask", "key_padding"), (q, k, v, attn_mask, key_padding)))
    call = graph.call_function(_SDPA, (q_node, k_node, v_node), {
        "attn_mask": mask_node, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
        "enable_gqa": enable_gqa})
    site = match_sdpa(call)
    site.name = name
    if structured and site.unsupported is None:
        site.structure = MaskStructure(causal=is_causal, diagonal=(diagonal, ()), window=window,
                                       key_padding=pad_node)
    return site


def _structured_sdpa(q, k, v, dropout_p, is_causal, scale, diagonal, window, key_padding):
    """BF16 SDPA over a causal structure and key padding: as a boolean mask, with K/V
    repeated for GQA (SDPA's CUDA kernels take ``enable_gqa`` only without a mask)."""
    nq, nk = q.shape[-2], k.shape[-2]
    keep = formats.visible(torch.arange(nq, device=q.device)[:, None], torch.arange(nk, device=q.device)[None, :],
                           is_causal, diagonal, window)
    if key_padding is not None:
        pad = key_padding[:, None, None, :]
        keep = pad if keep is None else keep & pad
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return _SDPA(q, k, v, keep, dropout_p, scale=scale)


@contextlib.contextmanager
def recording(names: dict | None = None):
    """Collect a ``SiteRecord`` for every eager attention call inside the block (for
    ``explain(eager=True)``), naming modules by ``names`` ({module: path})."""
    records: list[SiteRecord] = []
    _recorders.append(records)
    named = dict(names or {})
    _names.update(named)
    try:
        yield records
    finally:
        _recorders.remove(records)
        for module in named:
            _names.pop(module, None)


class patch:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through
    ``fp4_inductor.scaled_dot_product_attention``, process-wide:
    ``with fp4_inductor.patch(): ...`` inside the block only, ``p = fp4_inductor.patch()``
    until ``p.undo()``.  Code that looks the function up at call time (``F.scaled_dot_
    product_attention(...)``, ``nn.MultiheadAttention``, diffusers' native backend) is
    routed; a reference taken before (``from torch.nn.functional import ...``) is not."""

    def __init__(self):
        self._previous = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention

    def __enter__(self) -> "patch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def undo(self) -> None:
        """Restore what was there when this patch began (an outer patch stays)."""
        torch.nn.functional.scaled_dot_product_attention = self._previous
