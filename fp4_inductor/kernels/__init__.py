"""GPU kernels.  ``forward_kernel`` returns a launcher for the inputs' device, or None
where no kernel applies (then the ops run the reference emulation)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def has_forward_kernel(device: torch.device) -> bool:
    """Whether a low-precision forward kernel exists for this device (policy uses this)."""
    return device.type == "cuda" and _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


def forward_kernel(q: torch.Tensor, p_mode: str):
    if not has_forward_kernel(q.device):
        return None
    return None
