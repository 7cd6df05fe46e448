#!/usr/bin/env bash
# session 14: every GPU test, then the full side-by-side benchmark (modelled on session 13's run13.sh).
# The release builds travel as one xz tarball (.gpu/pack.tar.xz, carried alone): the tracked tree
# (about 46 MiB) and the unpacked .gpu (21 MiB) together are over the 64 MiB limit.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p $OUT/w; cd "$(dirname "$0")/../.."
if [ -f .gpu/pack.tar.xz ]; then
  python3 -c 'import tarfile; tarfile.open(".gpu/pack.tar.xz").extractall(".")' || tar xJf .gpu/pack.tar.xz
fi
ls -l .gpu/tests .gpu/bin .gpu/examples > $OUT/w/pack.txt 2>&1; cat .gpu/commit.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/w/gpu.txt
( for t in .gpu/tests/*; do echo "== $t"; CACHALOT_REQUIRE_GPU=1 timeout 60 $t --test-threads=1 2>&1 | tail -4; echo "rc ${PIPESTATUS[0]}"; done ) > $OUT/w/gpu_tests.txt 2>&1
echo "test result ok: $(grep -c 'test result: ok' $OUT/w/gpu_tests.txt) of $(ls .gpu/tests | wc -l)"
PASSES=5 HOT_PAIRS=${HOT_PAIRS:-400000} timeout ${BENCH_LIMIT:-420} scripts/gpu_bench.sh /tmp/bench > $OUT/w/bench.log 2>&1
echo bench rc $?
cp -r /tmp/bench/results.* /tmp/bench/*.svg /tmp/bench/machine.json $OUT/w/ 2>/dev/null
tar czf $OUT/w/runs.tgz -C /tmp/bench runs logs ops/SHA256SUMS
cd $OUT && tar czf s14.tgz w && rm -rf w
ls -l $OUT
