#!/usr/bin/env bash
# session 13, second run: every GPU test and the full side-by-side benchmark at the front end's
# change (1f68379; only the GPU tests of the front end and buffers travel), then the front end before (1e09ccd) and after, side by side on this GPU:
# cachalot with PyTorch's policy and the default, 5 passes, three rounds alternating.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p $OUT/w; cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/w/gpu.txt
( for t in .gpu/tests/*; do echo "== $t"; CACHALOT_REQUIRE_GPU=1 timeout 60 $t --test-threads=1 2>&1 | tail -4; done ) > $OUT/w/gpu_tests.txt 2>&1
grep -c "test result: ok" $OUT/w/gpu_tests.txt
PASSES=5 HOT_PAIRS=${HOT_PAIRS:-400000} timeout ${BENCH_LIMIT:-330} scripts/gpu_bench.sh /tmp/bench > $OUT/w/bench.log 2>&1
echo bench rc $?
cp -r /tmp/bench/results.* /tmp/bench/*.svg /tmp/bench/machine.json $OUT/w/ 2>/dev/null
tar czf $OUT/w/runs.tgz -C /tmp/bench runs logs ops/SHA256SUMS
for r in 1 2 3; do for b in base new; do
  timeout 60 $( [ $b = base ] && echo .gpu/ab/base || echo .gpu/examples/gpu_compare ) --out /tmp/ab/${b}_$r --passes 5 --no-hot --only cachalot-pytorch,cachalot /tmp/bench/ops/*.ops > /tmp/ab_${b}_$r.log 2>&1
  echo "ab $b $r rc $?"
done; done
tar czf $OUT/w/ab.tgz -C /tmp ab
cd $OUT && tar czf s13b.tgz w && rm -rf w
