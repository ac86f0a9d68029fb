"""GPU kernels.  ``forward_kernel`` returns a launcher for the inputs' device, or None
where no kernel applies (then the ops run the reference emulation)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def forward_kernel(q: torch.Tensor, p_mode: str):
    if q.device.type != "cuda" or not _is_sm90(q.device.index or 0):
        return None
    return None
