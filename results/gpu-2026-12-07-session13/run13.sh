#!/usr/bin/env bash
# session 13: every GPU test, then the full side-by-side benchmark
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p $OUT/w; cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/w/gpu.txt
( for t in .gpu/tests/*; do echo "== $t"; CACHALOT_REQUIRE_GPU=1 timeout 60 $t --test-threads=1 2>&1 | tail -4; done ) > $OUT/w/gpu_tests.txt 2>&1
grep -c "test result: ok" $OUT/w/gpu_tests.txt
PASSES=5 HOT_PAIRS=${HOT_PAIRS:-400000} timeout ${BENCH_LIMIT:-480} scripts/gpu_bench.sh /tmp/bench > $OUT/w/bench.log 2>&1
echo bench rc $?
cp -r /tmp/bench/results.* /tmp/bench/*.svg /tmp/bench/machine.json $OUT/w/ 2>/dev/null
tar czf $OUT/w/runs.tgz -C /tmp/bench runs logs ops/SHA256SUMS
cd $OUT && tar czf s13.tgz w && rm -rf w
