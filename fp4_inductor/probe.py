"""Running a model once under Dynamo with a backend that only looks: what ``explain()``
and ``tune()`` share."""

from __future__ import annotations

import torch


def run_once(model_or_fn, backend, *args, **kwargs) -> None:
    """Run ``model_or_fn`` once under Dynamo with ``backend``: the probe of ``explain()``
    and ``tune()``.  As ``torch._dynamo.explain`` does, Dynamo's caches are reset before
    (a cached frame would skip the backend) and after: each probe's frames would
    otherwise count toward Dynamo's recompile limit on the model's ``forward``, past which
    compiled models silently run eagerly.  The reset is process-wide: functions compiled
    before recompile on their next call (CUDA graphs re-record, automatic-dynamic shapes
    start static again).  FSDP2 modules are resharded after (``_reshard_fsdp``)."""
    torch._dynamo.reset()
    try:
        torch.compile(model_or_fn, backend=backend)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
        _reshard_fsdp(model_or_fn)


def _reshard_fsdp(model_or_fn) -> None:
    """Reshard the FSDP2 modules of a probed model: FSDP2 keeps the root's parameters
    unsharded after a forward, for the backward that follows; after a probe's forward
    alone, the next optimizer step would update the shards and leave the next forward
    reading the stale unsharded copy (a different loss curve on two CPU ranks,
    tests/test_parallel.py)."""
    if not (isinstance(model_or_fn, torch.nn.Module) and torch.distributed.is_available()):
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model_or_fn.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
