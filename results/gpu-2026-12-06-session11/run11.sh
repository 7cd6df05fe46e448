#!/bin/bash
# Session 11's short GPU run (little device time was left): cachalot's two policies side by side
# on every committed program (no PyTorch half, no hot loops), then every GPU test.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $R/gpu.txt
S=$(date +%s)
B=/tmp/b; mkdir -p $B/ops $B/logs
exp() { .gpu/bin/cachalot replay "$1" --pytorch --start live-tensors "${@:3}" --ops-out $B/ops/$2.ops > $B/logs/export_$2.log 2>&1 || echo "export $2 failed" >> $R/gpu.txt; }
for t in tests/fixtures/traces/*.pickle; do exp $t $(basename $t .pickle) & done; wait
for t in tests/fixtures/user/*.pickle.gz; do n=$(basename $t .pickle.gz); if [ $n = two_devices ]; then exp $t two_devices_dev0 --device 0; exp $t two_devices_dev1 --device 1; else exp $t $n & fi; done; wait
python3 scripts/synthetic_ops.py $B/ops > /dev/null
echo "ops $(ls $B/ops/*.ops | wc -l) at $(( $(date +%s)-S )) s" >> $R/gpu.txt
timeout 100 .gpu/examples/gpu_compare --out $B --passes 4 --no-hot --only cachalot-pytorch,cachalot $B/ops/*.ops > $B/logs/gpu_compare.log 2>&1
echo "compare rc=$? at $(( $(date +%s)-S )) s" >> $R/gpu.txt
cp .gpu/commit.txt $B/ 2>/dev/null
(cd $B && tar czf $R/bench.tgz runs logs commit.txt)
for t in .gpu/tests/*; do echo "== $t"; CACHALOT_REQUIRE_GPU=1 timeout 30 $t --test-threads=1 2>&1 | grep -E 'test result|FAILED|panicked'; done > $R/gpu_tests.txt 2>&1
echo "tests done at $(( $(date +%s)-S )) s" >> $R/gpu.txt
cat $R/gpu.txt; grep -c 'test result: ok' $R/gpu_tests.txt; grep -E 'FAILED|panicked' $R/gpu_tests.txt | head
