#!/usr/bin/env bash
# session 18 on the GPU machine. usage: bash results/gpu-2026-12-07-session18/run18.sh bench|tests
#   bench: the whole side-by-side benchmark (scripts/gpu_bench.sh), 5 timed passes, REPEATS=6
#          (cachalot's two policies replayed five more times; the report judges the 1.2x target
#          on the median of the paired ratios), every allocator, into $OUT/s18_bench.tgz.
#   tests: every GPU test executable (CACHALOT_REQUIRE_GPU=1), then the two allocator fuzz
#          targets on the host's CPUs for FUZZ_SECS (results/fuzz-2026-12-07/fuzz.sh).
# The release builds travel as one xz tarball (.gpu/pack.tar.xz); the fuzz binaries and corpora
# in .gpu-work/ (carry both).
MODE=${1:?bench or tests}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
cd "$(dirname "$0")/../.."
[ -d .gpu/bin ] || tar xJf .gpu/pack.tar.xz
cat .gpu/commit.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/gpu.txt
if [ "$MODE" = compact ]; then
  # the ops files as scripts/gpu_bench.sh exports them; six paired runs of cachalot's two
  # policies (5 passes, no hot loops), the same on the simulated device three times, then every
  # GPU test and the allocator fuzz targets for FUZZ_SECS
  W=/tmp/c18; mkdir -p $W/ops
  for t in tests/fixtures/traces/*.pickle; do .gpu/bin/cachalot replay "$t" --pytorch --start live-tensors --ops-out $W/ops/$(basename $t .pickle).ops > /dev/null 2>&1 || echo "export $t failed"; done
  for t in tests/fixtures/user/*.pickle.gz; do n=$(basename $t .pickle.gz)
    if [ $n = two_devices ]; then for d in 0 1; do .gpu/bin/cachalot replay $t --pytorch --start live-tensors --device $d --ops-out $W/ops/two_devices_dev$d.ops > /dev/null 2>&1; done
    else .gpu/bin/cachalot replay $t --pytorch --start live-tensors --ops-out $W/ops/$n.ops > /dev/null 2>&1 || echo "export $t failed"; fi; done
  python3 scripts/synthetic_ops.py $W/ops > /dev/null; ls $W/ops/*.ops | wc -l; (cd $W/ops && sha256sum *.ops > SHA256SUMS)
  # base: the packed commit's gpu_compare (.gpu/commit.txt); v1, when the pack holds one, a
  # second build to pair with it (.gpu/examples/gpu_compare_v1: e.g. another commit's, built in
  # a worktree), interleaved
  VS=base; [ -x .gpu/examples/gpu_compare_v1 ] && VS="base v1"
  for rep in 1 2 3 4 5 6; do for v in $VS; do x=.gpu/examples/gpu_compare; [ $v = v1 ] && x=${x}_v1
    $x --backend cuda --out $W/cuda_${v}_$rep --passes 5 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/cuda_${v}_$rep.log 2>&1; echo "cuda $v $rep rc $?"; done; done
  for rep in 1 2 3; do for v in $VS; do x=.gpu/examples/gpu_compare; [ $v = v1 ] && x=${x}_v1
    $x --backend sim --out $W/sim_${v}_$rep --passes 5 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/sim_${v}_$rep.log 2>&1; echo "sim $v $rep rc $?"; done; done
  for v in $VS; do for k in cuda_$v sim_$v; do echo "$k: $(python3 scripts/steady_ratio.py cachalot-pytorch cachalot $W/${k}_? | tail -2 | head -1)"; done; done
  (cd $W && tar czf $OUT/s18_compact.tgz cuda_* sim_* ops/SHA256SUMS)
  ( for t in .gpu/tests/*; do echo "== $t"; CACHALOT_REQUIRE_GPU=1 timeout 90 $t --test-threads=1 2>&1 | tail -4; echo "rc ${PIPESTATUS[0]}"; done ) > $OUT/gpu_tests.txt 2>&1
  echo "test result ok: $(grep -c 'test result: ok' $OUT/gpu_tests.txt) of $(ls .gpu/tests | wc -l)"
  grep -B3 "rc [1-9]" $OUT/gpu_tests.txt | head -20
  [ -d .gpu-work/bin ] && bash results/fuzz-2026-12-07/fuzz.sh ${FUZZ_SECS:-150} 8 8
elif [ "$MODE" = bench ]; then
  PASSES=5 REPEATS=6 HOT_PAIRS=${HOT_PAIRS:-200000} timeout ${BENCH_LIMIT:-555} scripts/gpu_bench.sh /tmp/bench > /tmp/bench.log 2>&1
  echo "bench rc $?"; grep "^== " /tmp/bench.log | tail -12
  cp /tmp/bench.log /tmp/bench/logs/bench.log
  # the same two allocators on the simulated device, on this host's CPU: whether the default's
  # steady ratio on the GPU is the host's CPU or the CUDA backend
  for i in 1 2 3; do .gpu/examples/gpu_compare --backend sim --out /tmp/bench/sim_$i --passes 5 --no-hot --only cachalot-pytorch,cachalot /tmp/bench/ops/*.ops > /dev/null 2>&1; echo "sim $i rc $?"; done
  python3 scripts/steady_ratio.py cachalot-pytorch cachalot /tmp/bench/sim_? | tail -2
  (cd /tmp/bench && tar czf $OUT/s18_bench.tgz results.* *.svg machine.json runs repeats logs sim_? ops/SHA256SUMS)
else
  ( for t in .gpu/tests/*; do echo "== $t"; CACHALOT_REQUIRE_GPU=1 timeout 90 $t --test-threads=1 2>&1 | tail -4; echo "rc ${PIPESTATUS[0]}"; done ) > $OUT/gpu_tests.txt 2>&1
  echo "test result ok: $(grep -c 'test result: ok' $OUT/gpu_tests.txt) of $(ls .gpu/tests | wc -l)"
  grep -B3 "rc [1-9]" $OUT/gpu_tests.txt | head -20
  bash results/fuzz-2026-12-07/fuzz.sh ${FUZZ_SECS:-330} 8 8
fi
ls -l $OUT
