#!/usr/bin/env bash
# A live snapshot from a Rust program, checked on the GPU machine: runs the `live_snapshot`
# example (cachalot's CUDA backend, a small two-stream workload, history recorded with Rust
# backtraces), then every `python -m torch.cuda._memory_viz` subcommand on the snapshot it
# wrote (scripts/check_memory_viz.sh: stats, trace, segments, memory, trace_plot,
# segment_plot), then `cachalot replay --pytorch --json` on it, and compares the replay's
# figures with the ones the program printed. Everything goes under $OUT:
#
#   rust_live.pickle       the snapshot (with backtraces)   rust_live.json    the program's figures
#   rust_live_nobt.pickle  the same workload, no backtraces rust_live_nobt.json
#   memviz/                memory_viz's outputs             memviz.log        its log
#   replay*.json           cachalot replay --json           compare.log       the comparison
#
# Run from the repository root after ../shared/gpu-pack (binaries in .gpu/):
#   OUT=/some/dir scripts/live_snapshot_gpu.sh
# Exits non-zero on the first failure. PYTHON as in check_memory_viz.sh.
set -euo pipefail

: "${OUT:?set OUT to the directory for results}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
example=.gpu/examples/live_snapshot
cachalot=.gpu/bin/cachalot
for f in "$example" "$cachalot"; do
    [ -x "$f" ] || { echo "$f missing: run ../shared/gpu-pack first" >&2; exit 1; }
done

export CACHALOT_REQUIRE_GPU=1
"$example" "$OUT/rust_live.pickle" | tee "$OUT/rust_live.json"
"$example" "$OUT/rust_live_nobt.pickle" --no-backtraces | tee "$OUT/rust_live_nobt.json"

KEEP="$OUT/memviz" PYTHON="$PY" scripts/check_memory_viz.sh \
    "$OUT/rust_live.pickle" "$OUT/rust_live_nobt.pickle" 2>&1 | tee "$OUT/memviz.log"

# The snapshot's keys, as PyTorch's pickle module reads them.
"$PY" - "$OUT/rust_live.pickle" <<'EOF' 2>&1 | tee "$OUT/keys.log"
import pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
print("top-level keys:", sorted(s))
print("segment keys:", sorted(s["segments"][0]))
print("block keys:", sorted(s["segments"][0]["blocks"][0]))
t = [e for tr in s["device_traces"] for e in tr]
print("entry keys:", sorted(t[0]))
print("actions:", sorted({e["action"] for e in t}))
framed = [e for e in t if e["frames"]]
print(f"{len(framed)} of {len(t)} entries have frames; first frames of an alloc:")
alloc = next(e for e in t if e["action"] == "alloc")
for f in alloc["frames"][:8]:
    print("   ", f)
EOF

status=0
for name in rust_live rust_live_nobt; do
    "$cachalot" replay "$OUT/$name.pickle" --pytorch --json >"$OUT/replay_$name.json"
    "$PY" - "$OUT/$name.json" "$OUT/replay_$name.json" <<'EOF' 2>&1 | tee -a "$OUT/compare.log" || status=1
import json, sys
own = json.load(open(sys.argv[1]))
rep = json.load(open(sys.argv[2]))
pairs = [
    ("max_memory_reserved", own["max_memory_reserved"], rep["peak_reserved_bytes"]),
    ("max_memory_allocated", own["max_memory_allocated"], rep["peak_allocated_bytes"]),
    ("memory_reserved", own["memory_reserved"], rep["final_reserved_bytes"]),
    ("segments", own["segments"], rep["final_segments"]),
]
bad = [p for p in pairs if p[1] != p[2]]
for what, a, b in pairs:
    print(f"{sys.argv[1]}: {what}: program {a}, cachalot replay {b}{'' if a == b else '  <-- differs'}")
sc = rep.get("self_check") or {}
print(f"{sys.argv[1]}: start {rep.get('start')}; self-check {sc}")
if bad or not sc.get("matches"):
    sys.exit(1)
EOF
done
[ "$status" = 0 ] && echo "live snapshot: memory_viz read it, cachalot replay matches the program's figures" | tee -a "$OUT/compare.log"
exit "$status"
