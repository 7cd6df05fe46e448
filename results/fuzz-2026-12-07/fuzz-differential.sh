#!/usr/bin/env bash
# differential only, corpus carried in; corpus not carried back (time).
set -u
secs=$1; jdi=$2
nproc; lscpu | grep -E "Model name|^CPU\(s\)" ; date -u
tar xJf .gpu-work/corpus.tar.xz -C fuzz
echo "differential corpus: $(ls fuzz/corpus/differential | wc -l)"
chmod +x .gpu-work/bin/*
PREBUILT=.gpu-work/bin CONCURRENT=1 TARGETS="differential" \
  JOBS_differential=$jdi fuzz/campaign.sh "$secs" 1 > $OUT/campaign.txt 2>&1
echo "campaign rc=$?" >> $OUT/campaign.txt
tail -8 $OUT/campaign.txt
tar czf $OUT/logs.tgz -C fuzz logs artifacts
ls -la $OUT; date -u
