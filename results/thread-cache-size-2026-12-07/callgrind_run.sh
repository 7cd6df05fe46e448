#!/bin/bash
# Instructions per steady line of one allocator of gpu_compare on the simulated device:
# callgrind counts the timed passes of a 2- and a 7-pass run; prints (I7 - I2) / 5 / lines.
# Ops files in /tmp/ops (exported as scripts/gpu_bench.sh does), output in /tmp/cg.
# usage: callgrind_run.sh BIN TRACE ALLOC TAG [CONF]
BIN=$1; t=$2; A=$3; TAG=$4; CONF=${5:-}
for p in 2 7; do
  extra=(); [ -n "$CONF" ] && extra=(--cachalot-config "$CONF")
  valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/${t}_$TAG.$p.cg --toggle-collect='*timed_passes*' $BIN --backend sim --out /tmp/cg/o_${t}_${TAG}_$p --passes $p --no-hot --only $A "${extra[@]}" /tmp/ops/$t.ops >/dev/null 2>&1
done
a=$(grep -E '^(summary|totals):' /tmp/cg/${t}_$TAG.2.cg | head -1 | awk '{print $2}')
b=$(grep -E '^(summary|totals):' /tmp/cg/${t}_$TAG.7.cg | head -1 | awk '{print $2}')
n=$(grep -cE '^[a-z]' /tmp/ops/$t.ops)
echo -e "$t\t$TAG\t$n\t$(( (b-a)/5/n ))"
