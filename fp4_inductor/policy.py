"""Which path each attention site takes, and why.

Support checks come first (anything the low-precision op cannot compute exactly as the
site means it stays as written); then the policy: ``never``, ``always`` (low precision
wherever supported; on a device without a kernel this runs the reference emulation),
or ``auto``.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import Options
from .kernels import has_forward_kernel
from .patterns.common import Site, value

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Decision:
    path: str  # "fp8" | "fp4" | "bf16"
    reason: str
    predicted_speedup: float | None = None

    @property
    def low_precision(self) -> bool:
        return self.path != "bf16"


def unsupported_reason(site: Site) -> str | None:
    if site.unsupported:
        return site.unsupported
    q, k, v = (value(n) for n in (site.q, site.k, site.v))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query, key or value is not a tensor"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device.type} is not supported"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (need one of fp16, bf16, fp32)"
    if not (q.dim() == k.dim() == v.dim()) or q.dim() not in (3, 4):
        return "query, key and value must all be 3-d or 4-d"
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1]):
        return "value head dim differs from query/key head dim"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"head dim {d} is not one of {SUPPORTED_HEAD_DIMS}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[-2] != v.shape[-2]:
        return "batch or key-length mismatch between query, key and value"
    if q.dim() == 4 and (k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] != 0):
        return "key/value heads do not divide query heads"
    if any(t.requires_grad for t in _mask_values(site)):
        return "mask or scale requires grad"
    scores = (*q.shape[:-1], k.shape[-2])
    for mask in _mask_values(site):
        if mask.dim() > 0 and not _broadcasts(mask.shape, scores):
            return f"mask of shape {tuple(mask.shape)} does not broadcast to scores {tuple(scores)}"
    return None


def _mask_values(site: Site) -> list[torch.Tensor]:
    nodes = [site.attn_mask, *site.keep_masks, *site.drop_masks, *(m for m, _ in site.bias_terms)]
    if isinstance(site.scale, tuple):
        nodes += [f for f, _ in site.scale]
    return [t for t in (value(n) for n in nodes) if isinstance(t, torch.Tensor)]


def _broadcasts(shape, target) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except RuntimeError:
        return False


def decide(site: Site, options: Options) -> Decision:
    reason = unsupported_reason(site)
    if reason is not None:
        return Decision("bf16", reason)
    if options.policy == "never":
        return Decision("bf16", "policy=never")
    device = value(site.q).device
    if options.policy == "always":
        where = "" if has_forward_kernel(device) else " (reference emulation: no kernel for this device)"
        return Decision(options.fmt, "policy=always" + where)
    if not has_forward_kernel(device):
        return Decision("bf16", "no low-precision kernel for this device")
    return Decision("bf16", "no measured cost table for this GPU yet; use policy='always' to force")
