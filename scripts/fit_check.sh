#!/usr/bin/env bash
# The GPU half of `cachalot fit` / `cachalot explain` (issue 14), run from the repository root on
# the GPU machine with .gpu carried (../shared/gpu-pack builds .gpu/bin/cachalot here):
#
#   scripts/fit_check.sh OUT
#
# 1. scripts/measure_reserve.py: the memory PyTorch holds outside its allocator (OUT/reserve.json,
#    the shape of results/fit/reserve.json);
# 2. scripts/record_unet.py: the U-Net seed recorded (OUT/unet/), and the seed's answers from the
#    carried binary with the measured reserve (OUT/unet/*.fit.txt|json, *.explain*.txt|json|html);
# 3. scripts/fit_check.py: PyTorch's own allocator, limited by set_per_process_memory_fraction to
#    each committed prediction (results/fit/predictions.json) and to 2 MiB less (OUT/fit_check/),
#    then the same for the U-Net recordings, predicted here by the carried binary
#    (OUT/fit_check_unet/).
# Exit code 1 when any step fails; every step's log is under OUT.
set -u
OUT=${1:?usage: scripts/fit_check.sh OUT}
CACHALOT=${CACHALOT:-.gpu/bin/cachalot}
JOBS=${JOBS:-4}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT/unet"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/cachalot-torch-ext}
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, platform; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', platform.python_version())"
  date -u +%Y-%m-%dT%H:%M:%SZ
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
rc=0
stamp reserve
python3 "$HERE/measure_reserve.py" --out "$OUT/reserve.json" > "$OUT/reserve.log" 2>&1 || { rc=1; tail -5 "$OUT/reserve.log"; }
RESERVE=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['reserve'])" "$OUT/reserve.json" 2>/dev/null || echo "")
echo "reserve: ${RESERVE:-not measured}"
stamp unet-record
python3 "$HERE/record_unet.py" --out "$OUT/unet" > "$OUT/unet/record.log" 2>&1 || { rc=1; tail -5 "$OUT/unet/record.log"; }
cat "$OUT/unet/record.log" | tail -3
stamp unet-answers
R=(); [ -n "$RESERVE" ] && R=(--reserve "$RESERVE")
for n in unet_train_eval unet_eval; do
  s="$OUT/unet/$n.pickle.gz"
  [ -f "$s" ] || continue
  "$CACHALOT" fit "$s" "${R[@]}" > "$OUT/unet/$n.fit.txt" 2>&1
  "$CACHALOT" fit "$s" "${R[@]}" --json > "$OUT/unet/$n.fit.json" 2>&1
  "$CACHALOT" explain "$s" --html "$OUT/unet/$n.explain.html" > "$OUT/unet/$n.explain.txt" 2>&1
  "$CACHALOT" explain "$s" --json > "$OUT/unet/$n.explain.json" 2>&1
  "$CACHALOT" replay "$s" --pytorch > "$OUT/unet/$n.replay.txt" 2>&1
done
E=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['phases']['eval_starts_at_entry'])" "$OUT/unet/unet_train_eval.json" 2>/dev/null || echo "")
if [ -n "$E" ]; then
  s="$OUT/unet/unet_train_eval.pickle.gz"
  "$CACHALOT" explain "$s" --at "entry:$E" > "$OUT/unet/unet_train_eval.explain_eval_start.txt" 2>&1
  "$CACHALOT" explain "$s" --at "entry:$E" --json > "$OUT/unet/unet_train_eval.explain_eval_start.json" 2>&1
  "$CACHALOT" explain "$s" --at "entry:$E" --html "$OUT/unet/unet_train_eval.explain_eval_start.html" > /dev/null 2>&1
fi
head -40 "$OUT/unet/unet_train_eval.fit.txt" "$OUT/unet/unet_eval.fit.txt" 2>/dev/null
stamp fit-check
python3 "$HERE/fit_check.py" --cachalot "$CACHALOT" --predictions results/fit/predictions.json \
  --work /tmp/cachalot-fit-check --out "$OUT/fit_check" --jobs "$JOBS" --timeout 120 > "$OUT/fit_check.log" 2>&1 || rc=1
tail -25 "$OUT/fit_check.log"
stamp fit-check-unet
if [ -f "$OUT/unet/unet_train_eval.pickle.gz" ]; then
  python3 "$HERE/fit_predictions.py" --cachalot "$CACHALOT" --out "$OUT/unet/predictions.json" \
    --fixtures "unet_train_eval=$OUT/unet/unet_train_eval.pickle.gz" "unet_eval=$OUT/unet/unet_eval.pickle.gz" \
    > "$OUT/unet/predictions.log" 2>&1 || rc=1
  python3 "$HERE/fit_check.py" --cachalot "$CACHALOT" --predictions "$OUT/unet/predictions.json" \
    --work /tmp/cachalot-fit-check-unet --out "$OUT/fit_check_unet" --jobs "$JOBS" --timeout 120 > "$OUT/fit_check_unet.log" 2>&1 || rc=1
  tail -8 "$OUT/fit_check_unet.log"
fi
stamp done
exit $rc
