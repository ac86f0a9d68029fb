"""The backward launcher's own Python time a call, on any machine (no GPU needed).

    python benchmarks/explore_launcher_host.py [--calls 300] [--profile] [--cuda] [--key-padding]

Runs ``kernels._backward`` (what ``kernels.backward_kernel`` returns: the Gluon dQ and
dK/dV kernels here) on CPU tensors (B=2, H=2, N=256, D=128, causal, P mode direct; the host work does not depend on
the shape) with every kernel launch (the Gluon kernels, the tiled transposes) replaced by
a no-op: what remains is our launcher's Python (checks, descriptors, layouts, views) and
its few small aten ops.  ``--cuda`` runs the same calls on a GPU with the real launches
(B=2, H=2, N=4096), so Triton's JIT dispatch is in the time: the calls are queued without
a sync and their kernels take less than the host, so the time is the host's.
``--key-padding`` gives the call a key-padding bias (the second sequence keeps half its
keys), what a padded fine-tuning batch's backward runs: the key-row tile ranges join the
launches.
``--profile`` prints cProfile's top entries, here all on one thread (in a training step
the backward runs on autograd's own thread, which cProfile does not follow reliably).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common
from explore_backward import bwd_operands  # noqa: E402

from fp4_inductor import formats as F  # noqa: E402
from fp4_inductor import kernels  # noqa: E402
from fp4_inductor.kernels.gluon import attention_bwd_dkdv, attention_bwd_dq  # noqa: E402
from fp4_inductor.kernels.triton import attention_bwd_prep, key_bias  # noqa: E402


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
    ap.add_argument("--cuda", action="store_true", help="real launches on the GPU")
    ap.add_argument("--key-padding", action="store_true", help="a key-padding bias")
    args = ap.parse_args()
    b, n = 2, 4096 if args.cuda else 256
    if args.cuda:
        _, operands = bwd_operands(b, 2, n, 128, device="cuda")
    else:
        attention_bwd_prep._transpose_kernel = attention_bwd_dq._dq_ws = attention_bwd_dkdv._dkdv_ws = NoLaunch()
        key_bias._tile_ranges = NoLaunch()
        _, operands = bwd_operands(b, 2, n, 128, device="cpu")
    if args.key_padding:
        keep = torch.arange(n, device=operands[0].device) < torch.tensor([[n], [n // 2]], device=operands[0].device)
        operands = (*operands[:13], F.mask_to_log2_bias(None, keep), *operands[14:])
    taken = []

    def recorded(choose):  # records whether the Gluon kernel took the call
        def run(*choose_args):
            taken.append(choose(*choose_args))
            return taken[-1]
        return run

    for name in ("_gluon_dkdv", "_gluon_dq"):
        setattr(kernels, name, recorded(getattr(kernels, name)))

    def sync():
        if args.cuda:
            torch.cuda.synchronize()

    def call():
        kernels._backward(*operands)

    call()
    assert taken == [True, True], "the Gluon kernels did not take the call"
    if not args.cuda:
        print(f"launches a call: {NoLaunch.launches}")
    for _ in range(20):
        call()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    print(f"launcher Python a call: {(time.perf_counter() - t0) / args.calls * 1e6:.0f} us")
    sync()
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [call() for _ in range(100)])
        for order in ("cumulative", "tottime"):
            pstats.Stats(prof).sort_stats(order).print_stats(25)


if __name__ == "__main__":
    main()
