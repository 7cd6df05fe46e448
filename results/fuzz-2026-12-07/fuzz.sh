#!/usr/bin/env bash
# One fuzz run on the GPU host's CPUs: prebuilt differential and device_faults, both at once,
# the corpus carried in (.gpu-work/corpus.tar.xz when present) and back ($OUT/corpus.tar.xz).
# usage: .gpu-work/fuzz.sh SECONDS JOBS_device_faults JOBS_differential
set -u
secs=$1; jdf=$2; jdi=$3
nproc; lscpu | grep -E "Model name|^CPU\(s\)" ; date -u
if [[ -f .gpu-work/corpus.tar.xz && ! -d fuzz/corpus/differential ]]; then
  tar xJf .gpu-work/corpus.tar.xz -C fuzz
fi
ls fuzz/corpus 2>/dev/null && for t in differential device_faults; do echo "$t corpus: $(ls fuzz/corpus/$t 2>/dev/null | wc -l)"; done
chmod +x .gpu-work/bin/*
PREBUILT=.gpu-work/bin CONCURRENT=1 TARGETS="device_faults differential" \
  JOBS_device_faults=$jdf JOBS_differential=$jdi fuzz/campaign.sh "$secs" 1 > $OUT/campaign.txt 2>&1
echo "campaign rc=$?" >> $OUT/campaign.txt
tail -8 $OUT/campaign.txt
tar cJf $OUT/corpus.tar.xz -C fuzz corpus
tar czf $OUT/logs.tgz -C fuzz logs artifacts
ls -la $OUT; date -u
