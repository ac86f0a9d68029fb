#!/usr/bin/env bash
# The owed GPU measurements, one runnable queue in priority order (docs/perf-notes/README.md
# says why each is owed).  Each item is time-boxed; logs and JSON land in $OUT (or
# benchmarks/results/queue/ when OUT is unset) and are packed into queue.tar.gz at the end.
#
#   bash benchmarks/gpu_queue.sh                 # every item, in order, within BUDGET_S
#   bash benchmarks/gpu_queue.sh ITEM [ITEM ...] # the named items, in the order given
#   BUDGET_S=540 bash benchmarks/gpu_queue.sh    # stop starting items once the budget is spent
#
# Set-up once per machine: the package (no deps), and the peers' wheels when an archive made
# by the device-site tool is present (.device-site/*.tar.xz, unpacked to /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-$root/benchmarks/results/queue}
mkdir -p "$out"
budget=${BUDGET_S:-570}
start=$SECONDS

setup() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
  for archive in .device-site/*.tar.xz; do
    [[ -s $archive ]] || continue
    mkdir -p /tmp/site && tar xJf "$archive" -C /tmp/site
  done
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/device.txt"
}

# A copy of the tree with a staged patch series applied (docs/staged/README.md).
staged_tree() {  # name of the patch file
  local dir=/tmp/staged-$1
  [[ -d $dir ]] && { echo "$dir"; return; }
  mkdir -p "$dir" && cp -a "$root"/. "$dir"/ && (cd "$dir" && git apply "docs/staged/$1.patch") >&2 || return 1
  echo "$dir"
}

# Items: each a function that writes $out/<item>.log (stdout and stderr) and its JSON.
item_calibrate() {  # #62: this GPU's cost table by the package's calibration, the fit refitted with it
  python3 benchmarks/cost_table.py --out "$out" --raw-out "$out"
}
item_cudnn_bwd_probe() {  # #60 item 4: the 1.5 rel-L2 of torch's cuDNN SDPA backward in bench_training
  python3 benchmarks/lab/probe_cudnn_backward.py --out "$out/cudnn_bwd_probe.json"
}
item_cudnn_bwd_bench() {  # #60 item 4: the bench's cuDNN row alone, after a CUDA-graph row, after every ours row
  for methods in "sdpa-cudnn-bf16" "ours-direct-graphs sdpa-cudnn-bf16" \
                 "ours-hybrid-cudnn ours-direct ours-direct-compiled sdpa-cudnn-bf16"; do
    echo "== $methods"
    python3 benchmarks/bench_attention.py --training --ns 4096 --ds 128 --methods $methods --out /tmp/cudnn_row
    python3 -c "import json; [print(r['method'], r['pass'], r.get('grad_rel_l2'), r['status'][:80]) for r in json.load(open('/tmp/cudnn_row.json'))['results']]"
  done
}
item_cudnn_order() {  # #60 item 4: our cuDNN backward call and torch's, in either order
  python3 benchmarks/lab/probe_cudnn_order.py --out "$out/cudnn_order.json"
}
item_convergence_hybrid_main() {  # the hybrid arm diverged (H100, 3000 steps): main without the staged series
  python3 benchmarks/train_gpt.py --arms bf16 fp8+bf16bwd --steps 1500 --seq 2048 --batch 8 --out "$out/convergence_hybrid"
  FP4ATTN_BF16_BACKWARD=flash python3 benchmarks/train_gpt.py --arms fp8+bf16bwd --steps 1500 --seq 2048 --batch 8 \
    --out "$out/convergence_hybrid_flash"
}
item_bench_corruption() {  # #60 item 4: which row changes what the cuDNN row computes
  python3 benchmarks/lab/probe_bench_corruption.py
}
item_bench_rows() {  # #60 item 4: bench_training's own run, checked after each row
  python3 benchmarks/lab/probe_bench_rows.py ours-hybrid-cudnn ours-direct ours-direct-compiled sdpa-cudnn-bf16
}
item_gpu_tests_hybrid() {  # the hybrid's BF16 backward in the smoothed frame, on the GPU kernels
  python3 -m pytest -q -m gpu tests/test_hybrid_gpu.py -x -rfE
}
item_gpu_tests_fixed() {  # #60 item 3: the GPU tests that failed or did not import on the H100
  python3 -m pytest -q -m gpu tests/test_masks.py tests/test_golden.py tests/test_minilm.py -x -rfE
}
item_convergence_fused() {  # #63: the one-kernel backward's convergence, E4M3 dO (owed item 9)
  local dir; dir=$(staged_tree fused-backward) || return 1
  (cd "$dir" && python3 benchmarks/train_gpt.py --arms bf16 fp8 fp8+bf16bwd fp8+fusedbwd --steps 3000 \
    --seq 2048 --batch 8 --out "$out/convergence_fused")
}

declare -A LIMIT=([calibrate]=330 [cudnn_bwd_probe]=120 [cudnn_bwd_bench]=150 [cudnn_order]=200 [bench_corruption]=200 [bench_rows]=150 [gpu_tests_hybrid]=150 [convergence_hybrid_main]=240 [gpu_tests_fixed]=240 [convergence_fused]=560)
ORDER=(calibrate gpu_tests_hybrid cudnn_bwd_probe cudnn_bwd_bench cudnn_order bench_corruption bench_rows convergence_hybrid_main gpu_tests_fixed convergence_fused)

setup
items=("$@")
((${#items[@]})) || items=("${ORDER[@]}")
for name in "${items[@]}"; do
  left=$((budget - (SECONDS - start)))
  limit=${LIMIT[$name]:-300}
  ((limit > left)) && limit=$left
  if ((limit < 30)); then echo "skip $name: budget spent" | tee -a "$out/summary.txt"; continue; fi
  t0=$SECONDS
  # functions are exported so `timeout` can run them in a child shell
  export -f "item_$name" staged_tree; export out root
  timeout --signal=INT --kill-after=15 "$limit" bash -c "item_$name" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc ${limit}s-box $((SECONDS - t0))s" | tee -a "$out/summary.txt"
done
(cd "$out" && tar czf queue.tar.gz ./*.log 2>/dev/null && rm -f ./*.log)
