#!/usr/bin/env bash
# session 17: cachalot's default against cachalot with PyTorch's policy on the GPU, 30 traces,
# no hot loops. usage: REPS="1 2" run17.sh reps | run17.sh pin | run17.sh bench
#   reps: three variants, 5 passes, interleaved, once per repetition in REPS:
#   base  = the committed allocator (6f3a793's),            --only cachalot-pytorch,cachalot
#   n0    = the same binary, thread_cache_blocks:0,          --only cachalot
#   vec   = base + rule 23's address index as a sorted vector, --only cachalot-pytorch,cachalot
#   pin:  base only, six repetitions pinned to one CPU (taskset -c 5), then two of 20 passes.
#   bench: scripts/gpu_bench.sh with REPEATS=6 (the report's paired medians), PyTorch skipped,
#          with the committed tools (.gpu-work/exp/new: bin/cachalot, examples/gpu_compare).
MODE=${1:-reps}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
cd "$(dirname "$0")/.."
tar xJf .gpu-work/exp.tar.xz -C .gpu-work
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/gpu.txt
W=/tmp/w17; mkdir -p $W/ops $W/logs
B=.gpu-work/exp/base; V=.gpu-work/exp/vec
# the ops files, as scripts/gpu_bench.sh exports them
for t in tests/fixtures/traces/*.pickle; do
  $B/cachalot replay "$t" --pytorch --start live-tensors --ops-out $W/ops/$(basename $t .pickle).ops > /dev/null 2>&1 || echo "export $t failed"
done
for t in tests/fixtures/user/*.pickle.gz; do
  n=$(basename $t .pickle.gz)
  if [ $n = two_devices ]; then
    $B/cachalot replay $t --pytorch --start live-tensors --device 0 --ops-out $W/ops/two_devices_dev0.ops > /dev/null 2>&1
    $B/cachalot replay $t --pytorch --start live-tensors --device 1 --ops-out $W/ops/two_devices_dev1.ops > /dev/null 2>&1
  else
    $B/cachalot replay $t --pytorch --start live-tensors --ops-out $W/ops/$n.ops > /dev/null 2>&1 || echo "export $t failed"
  fi
done
python3 scripts/synthetic_ops.py $W/ops > /dev/null
ls $W/ops/*.ops | wc -l
(cd $W/ops && sha256sum *.ops > SHA256SUMS)
if [ "$MODE" = reps ]; then
for rep in ${REPS:-1 2}; do
  $B/gpu_compare --backend cuda --out $W/base_$rep --passes 5 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/logs/base_$rep.log 2>&1; echo "base $rep rc $?"
  $B/gpu_compare --backend cuda --out $W/n0_$rep --passes 5 --no-hot --only cachalot --cachalot-config thread_cache_blocks:0 $W/ops/*.ops > $W/logs/n0_$rep.log 2>&1; echo "n0 $rep rc $?"
  $V/gpu_compare --backend cuda --out $W/vec_$rep --passes 5 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/logs/vec_$rep.log 2>&1; echo "vec $rep rc $?"
done
elif [ "$MODE" = bench ]; then
  BIN=$PWD/.gpu-work/exp/new SKIP_PYTORCH=1 REPEATS=6 PASSES=5 HOT_PAIRS=100000 \
    scripts/gpu_bench.sh $W/bench > $W/logs/bench.log 2>&1; echo "bench rc $?"
  grep -E "steady ns/op|driver calls per steady|memory: cachalot" $W/bench/results.md | cut -c1-400
  (cd $W/bench && tar czf $OUT/bench17.tgz results.md results.json results.csv machine.json runs repeats logs)
else
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor > $OUT/cpufreq.txt 2>&1
  grep MHz /proc/cpuinfo | head -16 >> $OUT/cpufreq.txt
  for rep in 1 2 3 4 5 6; do
    taskset -c 5 $B/gpu_compare --backend cuda --out $W/pin_$rep --passes 5 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/logs/pin_$rep.log 2>&1; echo "pin $rep rc $?"
  done
  for rep in 1 2; do
    $B/gpu_compare --backend cuda --out $W/p20_$rep --passes 20 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/logs/p20_$rep.log 2>&1; echo "p20 $rep rc $?"
  done
fi
cd $W && tar czf $OUT/runs17_$MODE.tgz $(ls -d base_* n0_* vec_* pin_* p20_* 2>/dev/null) logs ops/SHA256SUMS
ls -l $OUT
