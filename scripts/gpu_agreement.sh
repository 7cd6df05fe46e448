#!/usr/bin/env bash
# The GPU half of the GPU-vs-simulation agreement check (issue 4): replays every committed
# PyTorch trace on a real GPU with the built `cachalot` binary and writes, per fixture NAME,
#   OUT/gpu_NAME.pickle.gz    the GPU replay as a PyTorch snapshot (final segments and blocks
#                             with the GPU's own addresses, and the allocator's history)
#   OUT/gpu_NAME.result.json  `cachalot replay --json` of the GPU replay (peak reserved,
#                             segments, device allocs, real ns per operation, ...)
# plus OUT/gpu.txt (the GPU) and OUT/agreement.txt: on the same machine, each GPU snapshot
# replayed on the simulated device (which then hands out the GPU's segment addresses), and
# whether peak reserved, peak segments, device allocs and frees and the final layout (every
# segment and block: address, size, requested size, state) agree.
# tests/gpu_agreement.rs makes the same comparison from these files, on any machine.
#
# usage: scripts/gpu_agreement.sh OUT [CACHALOT_BINARY]
#   CACHALOT_BINARY defaults to .gpu/bin/cachalot (../shared/gpu-pack -p cachalot-tools),
#   else target/release/cachalot.
set -euo pipefail
out=${1:?usage: $0 OUT [CACHALOT_BINARY]}
bin=${2:-}
if [ -z "$bin" ]; then
    if [ -x .gpu/bin/cachalot ]; then bin=.gpu/bin/cachalot; else bin=target/release/cachalot; fi
fi
repeat=${REPEAT:-3}
# CONFIG=expandable_segments:True: the same check with a setting on top of each trace's own
# (both the GPU replay and the simulated replay of its snapshot run with it).
config_args=()
if [ -n "${CONFIG:-}" ]; then config_args=(--config "$CONFIG"); fi
# POLICY=cachalot: replay under cachalot's own policy (rules 20, 21) instead of PyTorch's
# settings; the snapshot then records cachalot's settings, and its simulated replay reads them.
policy_args=(--pytorch)
if [ "${POLICY:-pytorch}" = cachalot ]; then policy_args=(); fi
backend=${BACKEND:-cuda} # BACKEND=sim: a dry run of this script on a machine without a GPU
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true; } >"$out/gpu.txt"
echo "GPU: $(cat "$out/gpu.txt")"
fail=0
: >"$out/agreement.txt"
for trace in tests/fixtures/traces/*.pickle; do
    name=$(basename "$trace" .pickle)
    snap="$out/gpu_$name.pickle.gz"
    json="$out/gpu_$name.result.json"
    "$bin" replay "$trace" "${policy_args[@]}" "${config_args[@]}" --backend "$backend" --repeat "$repeat" --json \
        --snapshot-out "$snap" >"$json"
    total=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["device_total_bytes"])' "$json")
    sim_snap="$work/sim_$name.pickle.gz"
    "$bin" replay "$snap" --pytorch "${config_args[@]}" --json --device-memory "$total" \
        --snapshot-out "$sim_snap" >"$out/sim_$name.json"
    python3 - "$name" "$json" "$out/sim_$name.json" "$snap" "$sim_snap" >>"$out/agreement.txt" <<'PY' || fail=1
import gzip, json, pickle, sys
name, gpu_json, sim_json, gpu_snap, sim_snap = sys.argv[1:]
g, s = json.load(open(gpu_json)), json.load(open(sim_json))
keys = ["peak_reserved_bytes", "peak_allocated_bytes", "peak_segments", "device_allocs",
        "device_frees", "ooms", "final_segments", "final_reserved_bytes"]
diff = [f"{k}: gpu {g[k]} sim {s[k]}" for k in keys if g[k] != s[k]]
def layout(path):
    with gzip.open(path, "rb") as f:
        snap = pickle.load(f)
    return [(seg["address"], seg["total_size"], seg["stream"], seg["segment_type"],
             [(b["address"], b["size"], b["requested_size"], b["state"]) for b in seg["blocks"]])
            for seg in snap["segments"]]
gl, sl = layout(gpu_snap), layout(sim_snap)
if gl != sl:
    first = next((i for i, (a, b) in enumerate(zip(gl, sl)) if a != b), min(len(gl), len(sl)))
    diff.append(f"final layout differs from segment {first} on ({len(gl)} vs {len(sl)} segments)")
vs = "= PyTorch" if g.get("pytorch_peak_reserved_bytes") == g["peak_reserved_bytes"] else \
     f"PyTorch {g.get('pytorch_peak_reserved_bytes')}"
print(f"{name:22} gpu peak reserved {g['peak_reserved_bytes']:>13} ({vs}), "
      f"{g['peak_segments']:>3} segments, {g['ns_per_op']:8.0f} ns/op on the GPU: "
      + ("AGREE" if not diff else "DIFFER " + "; ".join(diff)))
sys.exit(1 if diff else 0)
PY
    tail -n 1 "$out/agreement.txt"
done
if [ "$fail" = 0 ]; then
    echo "all fixtures: the GPU replay and the simulated replay of its snapshot agree" | tee -a "$out/agreement.txt"
else
    echo "some fixtures DIFFER (see above)" | tee -a "$out/agreement.txt"
fi
exit "$fail"
