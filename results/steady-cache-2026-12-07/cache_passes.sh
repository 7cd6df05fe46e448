#!/bin/bash
# Steady-pass cache and branch events of one allocator of gpu_compare on the simulated device:
# callgrind with its cache and branch simulation over the timed passes (--toggle-collect) of a
# 2-pass and a 7-pass run of the same ops files; cache_table.py takes (7-pass - 2-pass) / 5.
# usage: OPS=DIR cache_passes.sh GPU_COMPARE OUTDIR ALLOCATOR TRACE...  -> OUTDIR/ALLOCATOR_{2,7}.cg
OPS=${OPS:?OPS: the folder of the .ops files}
BIN=$1; OUT=$2; ALLOC=$3; shift 3
files=(); for t in "$@"; do files+=("$OPS/$t.ops"); done
mkdir -p "$OUT"
for p in 2 7; do
  valgrind --tool=callgrind --cache-sim=yes --branch-sim=yes --toggle-collect='*timed_passes*' \
    --callgrind-out-file="$OUT/${ALLOC}_$p.cg" "$BIN" --backend sim --out "$OUT/o_${ALLOC}_$p" \
    --passes $p --no-hot --only "$ALLOC" "${files[@]}" > /dev/null 2>&1
done
