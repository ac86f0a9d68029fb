export PYTHONPATH=$PWD
timeout -s TERM 200 python benchmarks/quant_overhead.py > $OUT/qo.txt 2>&1; tail -25 $OUT/qo.txt; cp benchmarks/results/quant_overhead*.json $OUT/ 2>/dev/null; ls $OUT
