#!/usr/bin/env bash
# The side-by-side GPU benchmark (docs/GPU_BENCH.md), in one command on the GPU machine:
#
#   scripts/gpu_bench.sh OUT
#
# run from the repository root with the release builds gathered in .gpu/ by
# `../shared/gpu-pack -p cachalot -p cachalot-tools` (the GPU machine has no Rust; it needs
# .gpu/bin/cachalot and .gpu/examples/gpu_compare, PyTorch with CUDA, nvidia-smi).
# It writes OUT/machine.json, the operation files OUT/ops/*.ops (every committed trace's
# program from `cachalot replay --ops-out`, and scripts/synthetic_ops.py's), one JSON per run
# under OUT/runs/, logs under OUT/logs/, and the report: OUT/results.{json,csv,md} and the
# SVG plots (`cachalot bench-report OUT`). Committed as results/gpu-bench/.
#
# Environment: PASSES (timed passes per run, default 3), JOBS (PyTorch's observed passes at
# once, default 4), MALLOC_PREFIX (cuMemAlloc's lines per trace, default 4000), HOT_PAIRS
# (pairs per hot loop, default 1000000), ONLY (a regular expression: only the ops files whose
# name matches, for a quick check), CACHALOT_CONFIG (settings applied to cachalot's policies:
# gpu_compare's --cachalot-config), SKIP_PYTORCH=1 (cachalot, the pool and cuMemAlloc only),
# REPEATS (default 1: with R > 1, gpu_compare replays every trace R - 1 more times with cachalot's
# two policies only, no hot loops, into OUT/repeats/K/, and the report judges the steady-speed
# target on the median of the paired ratios: docs/GPU_BENCH.md, "How precise the steady figure
# is").
set -uo pipefail
OUT=${1:?usage: scripts/gpu_bench.sh OUT}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
BIN=${BIN:-$ROOT/.gpu}
PASSES=${PASSES:-3}
JOBS=${JOBS:-4}
MALLOC_PREFIX=${MALLOC_PREFIX:-4000}
HOT_PAIRS=${HOT_PAIRS:-1000000}
ONLY=${ONLY:-.}
REPEATS=${REPEATS:-1}
mkdir -p "$OUT/ops" "$OUT/runs" "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
# The PyTorch extension's build, kept between runs on a warm machine.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.gpu-work/torch_extensions}
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
failed=0

stamp machine
python3 - "$OUT/machine.json" "$BIN" <<'EOF'
import json, os, platform, subprocess, sys, datetime
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:
        return f"unknown ({e})"
m = {}
m["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
m["gpu"] = sh("nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1")
m["driver"] = sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1")
try:
    import torch
    m["pytorch"] = torch.__version__
    m["cuda (PyTorch's)"] = torch.version.cuda
except Exception as e:
    m["pytorch"] = f"not importable: {e}"
m["python"] = platform.python_version()
m["cpu"] = sh("lscpu | sed -n 's/^Model name: *//p' | head -1") + f", {os.cpu_count()} logical CPUs"
m["kernel"] = platform.release()
commit = os.path.join(sys.argv[2], "commit.txt")
m["cachalot"] = open(commit).read().strip() if os.path.exists(commit) else sh("git rev-parse HEAD") or "unknown"
json.dump(m, open(sys.argv[1], "w"), indent=1)
print(json.dumps(m, indent=1))
EOF

stamp ops
export_ops() {  # SNAPSHOT NAME [cachalot replay args...]
  local snap=$1 name=$2
  shift 2
  if ! "$BIN/bin/cachalot" replay "$snap" --pytorch --start live-tensors "$@" \
      --ops-out "$OUT/ops/$name.ops" > "$OUT/logs/export_$name.log" 2>&1; then
    echo "exporting $snap failed:"; tail -5 "$OUT/logs/export_$name.log"; failed=1
  fi
}
for t in "$ROOT"/tests/fixtures/traces/*.pickle; do
  export_ops "$t" "$(basename "$t" .pickle)"
done
for t in "$ROOT"/tests/fixtures/user/*.pickle.gz; do
  name=$(basename "$t" .pickle.gz)
  if [ "$name" = two_devices ]; then
    export_ops "$t" two_devices_dev0 --device 0
    export_ops "$t" two_devices_dev1 --device 1
  else
    export_ops "$t" "$name"
  fi
done
python3 "$HERE/synthetic_ops.py" "$OUT/ops" || failed=1
mapfile -t OPS < <(ls "$OUT"/ops/*.ops | grep -E "$ONLY")
(cd "$OUT/ops" && sha256sum *.ops > SHA256SUMS)
echo "${#OPS[@]} operation files"

stamp cachalot-pool-cumemalloc
CONFIG=()
[ -n "${CACHALOT_CONFIG:-}" ] && CONFIG=(--cachalot-config "$CACHALOT_CONFIG")
"$BIN/examples/gpu_compare" --out "$OUT" --passes "$PASSES" --malloc-prefix "$MALLOC_PREFIX" \
  --hot-pairs "$HOT_PAIRS" "${CONFIG[@]}" "${OPS[@]}" 2>&1 | tee "$OUT/logs/gpu_compare.log" || failed=1

for ((k = 2; k <= REPEATS; k++)); do
  stamp "repeat $k of $REPEATS"
  "$BIN/examples/gpu_compare" --out "$OUT/repeats/$k" --passes "$PASSES" --no-hot \
    --only cachalot-pytorch,cachalot "${CONFIG[@]}" "${OPS[@]}" > "$OUT/logs/repeat_$k.log" 2>&1 || failed=1
done

if [ -z "${SKIP_PYTORCH:-}" ]; then
  stamp pytorch
  python3 "$HERE/pytorch_bench.py" --out "$OUT" --passes "$PASSES" --jobs "$JOBS" \
    --hot-pairs "$HOT_PAIRS" "${OPS[@]}" 2>&1 | tee "$OUT/logs/pytorch_bench.log" || failed=1
fi

stamp report
"$BIN/bin/cachalot" bench-report "$OUT" > "$OUT/logs/report.log" 2>&1 || failed=1
tail -n +1 "$OUT/results.md" 2>/dev/null | head -150
stamp done
exit $failed
