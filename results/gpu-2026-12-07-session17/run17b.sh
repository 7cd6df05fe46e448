#!/usr/bin/env bash
# session 17: cachalot's default against cachalot with PyTorch's policy on the GPU, 30 traces,
# 5 passes, no hot loops, three variants on one machine, twice each, interleaved:
#   base  = the committed allocator (6f3a793's),            --only cachalot-pytorch,cachalot
#   n0    = the same binary, thread_cache_blocks:0,          --only cachalot
#   vec   = base + rule 23's address index as a sorted vector, --only cachalot-pytorch,cachalot
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
for rep in 1 2 3; do
  $B/gpu_compare --backend cuda --out $W/p20base_$rep --passes 20 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/logs/p20base_$rep.log 2>&1; echo "p20base $rep rc $?"
  $V/gpu_compare --backend cuda --out $W/p20vec_$rep --passes 20 --no-hot --only cachalot-pytorch,cachalot $W/ops/*.ops > $W/logs/p20vec_$rep.log 2>&1; echo "p20vec $rep rc $?"
done
tail -3 $W/logs/p20base_1.log
cd $W && tar czf $OUT/runs17b.tgz p20base_* p20vec_* logs ops/SHA256SUMS
ls -l $OUT
