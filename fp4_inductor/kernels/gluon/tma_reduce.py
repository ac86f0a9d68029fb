"""TMA reduce-add from shared memory into global memory (``cp.reduce.async.bulk.tensor``
``.add``) for Gluon on sm_90.

Triton 3.6's ``hopper.tma`` does not export it, though its builder has the op
(``GluonOpBuilder.create_async_tma_reduce``, which the async TMA store's lowering shares);
later Triton exports it as ``tma.async_atomic_add``, which is used where present.  Like an
async TMA store it reads the shared memory asynchronously: ``tma.store_wait(n)`` before the
buffer is written again.
"""

from __future__ import annotations

from triton.experimental.gluon.language import _core as ttgl
from triton.experimental.gluon.language.nvidia.hopper import tma

if hasattr(tma, "async_atomic_add"):
    async_reduce_add = tma.async_atomic_add
else:
    @ttgl.builtin
    def async_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into ``tensor_desc``'s block at ``coord``."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ttgl.ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
