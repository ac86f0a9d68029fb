export PYTHONPATH=$PWD
timeout -s TERM 100 python -m pytest -m gpu -n 16 -q -p no:cacheprovider --tb=line tests/test_kernels_gpu.py -k "key_bias or gluon_structures or dispatch_picks" 2>&1 | grep -E "^E |passed|failed|rror" | head -20
timeout -s TERM 110 python benchmarks/lab/explore_masked_sites.py > $OUT/masked.txt 2>&1; tail -11 $OUT/masked.txt; cp benchmarks/results/lab/explore_masked_sites_h200.json $OUT/ 2>/dev/null
