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
item_convergence_hybrid() {  # the hybrid after both of its fixes, 3000 steps, each BF16 backward in its own process
  python3 benchmarks/train_gpt.py --arms bf16 fp8+bf16bwd --steps 3000 --seq 2048 --batch 8 --out "$out/convergence_hybrid"
  FP4ATTN_BF16_BACKWARD=flash python3 benchmarks/train_gpt.py --arms fp8+bf16bwd --steps 3000 --seq 2048 --batch 8 \
    --out "$out/convergence_hybrid_flash"
}
item_policy_grid() {  # #62 item 4: auto against the faster path on this GPU, with its shipped table
  python3 benchmarks/policy_grid.py --out "$out/policy_grid"
}
item_model_rows() {  # #62 item 4: model rows, auto against always, fp4attn-bf16 and torch.compile's default
  python3 benchmarks/bench_model.py --workloads prefill flux --seqs 4096 16384 --layers 8 --flux-sizes 1024 2048 \
    --out "$out/model_rows.json"
}
item_head_dims_staged() {  # owed item 11: the staged Gluon forward at head dims 33-128, its GPU tests
  local dir; dir=$(staged_tree gluon-forward-head-dims) || return 1
  (cd "$dir" && python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k odd_head_dims -rfE)
}
item_gpu_tests_fixed() {  # #60 item 3: the GPU tests that failed or did not import on the H100
  python3 -m pytest -q -m gpu tests/test_masks.py tests/test_golden.py tests/test_minilm.py -x -rfE
}

declare -A LIMIT=([gpu_tests_fixed]=240 [policy_grid]=560 [model_rows]=560 [convergence_hybrid]=400 [calibrate]=330 [head_dims_staged]=240)
# calibrate last: the H100's table ships (2026-12-06); on an H200 it refreshes that table
ORDER=(gpu_tests_fixed policy_grid model_rows convergence_hybrid head_dims_staged calibrate)

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
