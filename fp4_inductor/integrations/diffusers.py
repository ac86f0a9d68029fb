"""diffusers: fp4_inductor's eager attention in a model's attention processors.

diffusers' attention dispatcher takes backends from a fixed enum (``AttentionBackendName``;
its registry is private), so none can be added from outside.  ``use_fp4attn(model)`` keeps
each attention module's own processor (its projections, norms, RoPE) and routes the SDPA
calls it makes (diffusers' native backend, or SDPA called directly) to
``eager.attention``, named by the module's path.  The routing is a ``TorchFunctionMode``
entered only around the processor's call: no global patch.

Under ``torch.compile`` the mode is not entered: Dynamo breaks the graph on the
Python-level Tensor methods a mode makes it inline (``Tensor.unflatten`` in FLUX's
processor, torch 2.13).  Compiled, ``backend="fp4attn"`` rewrites these SDPA calls itself,
and ``fp4_inductor.patch()`` around the compiled call routes them for any backend.
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode

from .. import eager


class _RouteSDPA(TorchFunctionMode):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is eager._SDPA:
            return eager.attention(*args, **kwargs, name=self.name)
        return func(*args, **kwargs)


@functools.cache
def _routed(cls: type) -> type:
    """``cls`` with its call routed: the same class for every check diffusers makes
    (``isinstance``, the backend and parallel-config attributes, the call's signature,
    from which the module picks the keyword arguments it passes)."""

    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return cls.__call__(self, *args, **kwargs)
        with _RouteSDPA(self._fp4attn_name):
            return cls.__call__(self, *args, **kwargs)

    return type(f"FP4Attn{cls.__name__}", (cls,), {"__call__": __call__, "__module__": __name__})


def use_fp4attn(model: torch.nn.Module) -> torch.nn.Module:
    """Route the eager attention of a diffusers model (``FluxTransformer2DModel``,
    ``WanTransformer3DModel``, any with ``attn_processors``) through fp4_inductor's
    policy; returns ``model``.  Only SDPA calls are routed: a processor set to another
    backend (``set_attention_backend``) keeps it.  ``model.set_attn_processor`` (or
    ``set_default_attn_processor``) undoes it."""
    processors = {}
    for key, processor in model.attn_processors.items():
        routed = object.__new__(_routed(type(processor)))
        routed.__dict__.update(vars(processor))
        routed._fp4attn_name = key.removesuffix(".processor")
        processors[key] = routed
    model.set_attn_processor(processors)
    return model
