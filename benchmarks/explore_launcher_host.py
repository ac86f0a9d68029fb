"""The backward launcher's own Python time a call, on any machine (no GPU needed).

    python benchmarks/explore_launcher_host.py [--calls 300] [--profile]

Runs ``kernels.triton.attention_backward`` with the Gluon dQ and dK/dV hooks on CPU
tensors (B=1, H=2, N=128, D=128, causal, P mode direct; the host work does not depend on
the shape) with every kernel launch (the Gluon kernels, the tiled transposes) replaced by
a no-op: what remains is our launcher's Python (checks, descriptors, layouts, views) and
its few small aten ops.  Triton's JIT dispatch and the CUDA side are not in it: on a GPU,
``explore_host.py`` measures the whole.  ``--profile`` prints cProfile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from explore_backward import bwd_operands  # noqa: E402

from fp4_inductor import kernels  # noqa: E402
from fp4_inductor.kernels.gluon import attention_bwd_dkdv, attention_bwd_dq  # noqa: E402
from fp4_inductor.kernels.triton import attention_bwd  # noqa: E402


class NoLaunch:
    """Stands for a jitted kernel: ``kernel[grid](*args)`` counts the launch and does nothing."""

    launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            NoLaunch.launches += 1
        return launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    attention_bwd._transpose_kernel = attention_bwd_dq._dq_ws = attention_bwd_dkdv._dkdv_ws = NoLaunch()

    _, operands = bwd_operands(1, 2, 128, 128, device="cpu")
    taken = []

    def hook(name):
        def run(*hook_args):
            taken.append(getattr(kernels, name)(*hook_args, bias=None, p_mode="direct"))
            return taken[-1]
        return run

    def call():
        attention_bwd.attention_backward(*operands, dq_kernel=hook("_gluon_dq"), dkdv_kernel=hook("_gluon_dkdv"))

    call()
    assert taken == [True, True], "the Gluon hooks did not take the call"
    print(f"launches a call: {NoLaunch.launches}")
    for _ in range(20):
        call()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    print(f"launcher Python a call: {(time.perf_counter() - t0) / args.calls * 1e6:.0f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [call() for _ in range(100)])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
