#!/bin/bash
# Instructions per steady operation of one allocator of gpu_compare on the simulated device,
# every .ops file in $OPS: callgrind counts the timed passes (--toggle-collect) of a 2-pass and
# a 7-pass run; (I7 - I2) / 5 / lines is the steady cost per line (the first pass cancels out).
# usage: OPS=DIR callgrind_passes.sh GPU_COMPARE OUTDIR NAME ALLOCATOR [CONF] -> OUTDIR/NAME.tsv
# (trace, lines, instructions of the 2-pass run, of the 7-pass run)
OPS=${OPS:?OPS: the folder of the .ops files}
BIN=$1; OUT=$2; NAME=$3; ALLOC=$4; CONF=${5:-}
mkdir -p $OUT/$NAME
run() { # trace passes
  local t=$1 p=$2 extra=()
  [ -n "$CONF" ] && extra=(--cachalot-config "$CONF")
  valgrind --tool=callgrind --callgrind-out-file=$OUT/$NAME/$t.$p.cg --toggle-collect='*timed_passes*' $BIN --backend sim --out $OUT/$NAME/o_${t}_$p --passes $p --no-hot --only $ALLOC "${extra[@]}" $OPS/$t.ops >/dev/null 2>&1
  grep -E '^(summary|totals):' $OUT/$NAME/$t.$p.cg | head -1 | awk '{print $2}'
}
for f in $OPS/*.ops; do
  t=$(basename $f .ops)
  n=$(grep -cE '^[a-z]' $f)
  a=$(run $t 2); b=$(run $t 7)
  echo -e "$t\t$n\t$a\t$b"
done > $OUT/$NAME.tsv
