#!/usr/bin/env bash
# The large-snapshot benchmark of the real-snapshots issue: the whole `cachalot replay` of a
# 39 MB PyTorch 2.11 snapshot recorded at _record_memory_history()'s defaults (128,897 trace
# entries, 86 stack frames each; tests/fixtures/user/gpt2_generate_large.pickle.gz), against
# Python's pickle.load of the same file, on this machine. Prints wall time and peak RSS of
# each run (GNU time). Results: results/real_snapshots.md.
#
# usage: scripts/bench_large_snapshot.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
plain="${TMPDIR:-/tmp}/cachalot-large.pickle"
gunzip -c tests/fixtures/user/gpt2_generate_large.pickle.gz > "$plain"
cargo build --release --quiet
echo "file: $(stat -c %s "$plain") bytes; machine: $(nproc) cores, $(uname -m); $(date -u +%F)"
for i in $(seq "$runs"); do
  /usr/bin/time -f "cachalot replay --pytorch   %e s wall  %M KB peak RSS" \
    target/release/cachalot replay "$plain" --pytorch > /dev/null
done
for i in $(seq "$runs"); do
  python3 - "$plain" <<'PY'
import pickle, resource, sys, time
t = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    pickle.load(f)
dt = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"python pickle.load (in-process)  {dt:.2f} s  {rss} KB peak RSS")
PY
done
rm -f "$plain"
