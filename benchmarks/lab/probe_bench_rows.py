"""bench_training's own run (4k, D = 128, causal) with a check after each row: do the
leaves, dO or the reference gradients change, and what does torch's cuDNN backward give
on fresh copies of the leaves at that point?

    python benchmarks/lab/probe_bench_rows.py ROW [ROW ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_training  # noqa: E402

timed = bench_training._time_method
cudnn = bench_training._sdpa("CUDNN_ATTENTION", True)


def checked(setup, leaves, dout, ref, fwd_flops, rows, triton):
    before = [t.detach().cpu().clone() for t in (*leaves, dout, *ref)]
    timed(setup, leaves, dout, ref, fwd_flops, rows, triton)
    torch.cuda.synchronize()
    changed = [i for i, (t, c) in enumerate(zip((*leaves, dout, *ref), before)) if not torch.equal(t.detach().cpu(), c)]
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    err = max(bench_training._rel_l2(g, r) for g, r in zip(cudnn(fresh, dout)[2], ref))
    print(f"after {rows[0]['method']}: row {rows[0].get('grad_rel_l2')}, changed {changed or 'nothing'} "
          "(0-2 leaves, 3 dO, 4-6 reference), cuDNN on fresh leaves", round(err, 4), flush=True)


bench_training._time_method = checked
bench_training.run([4096], [128], True, "/tmp/rows.json", "/tmp/rows.png", sys.argv[1:])
