#!/usr/bin/env bash
# Steady ns/op of `cachalot replay --pytorch --repeat 5` on the 11 real traces (the 10 of
# tests/fixtures/traces and resnet50_warm), best of N runs each (default 5), and their
# geometric mean. Usage: replay_ns.sh [path/to/cachalot] [N]
set -euo pipefail
bin=${1:-target/release/cachalot}
n=${2:-5}
traces=(tests/fixtures/traces/*.pickle tests/fixtures/user/resnet50_warm.pickle.gz)
logsum=0
for t in "${traces[@]}"; do
  best=
  for _ in $(seq "$n"); do
    ns=$("$bin" replay --pytorch --repeat 5 --json "$t" 2>/dev/null |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["ns_per_op"])')
    best=$(python3 -c "print(min(float('$ns'), float('${best:-inf}')))")
  done
  printf '%-28s %8.1f\n' "$(basename "$t")" "$best"
  logsum=$(python3 -c "import math; print($logsum + math.log($best))")
done
python3 -c "import math; print('%-28s %8.1f' % ('geometric mean', math.exp($logsum / ${#traces[@]})))"
