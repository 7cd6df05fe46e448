#!/usr/bin/env bash
# The GPU half of results/pytorch-replay-2026-12-01/: PyTorch's own allocator on the operation
# programs cachalot exported, and new recordings under expandable segments.
#
#   scripts/pytorch_replay_gpu.sh WORK OUT
#
# WORK holds what the CPU half made (scripts/pytorch_replay_jobs.py --out WORK/pj ...): the ops
# files and WORK/pj/jobs.json, and a cachalot binary in WORK/bin (x86-64 release build) for
# exporting the new recordings' operations. OUT receives machine.txt and three archives:
# fixtures.tgz (one JSON per replay, snapshots of the expandable replays), recordings.tgz (the
# new recordings under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and
# expandable_replays.tgz (their ops, cachalot's reports and the PyTorch replays of them).
set -u
WORK=$(cd "$1" && pwd)
OUT=$2
HERE=$(cd "$(dirname "$0")" && pwd)
export TORCH_EXTENSIONS_DIR=$WORK/ext PYTHONUNBUFFERED=1
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, platform; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', platform.python_version())"
  date -u +%Y-%m-%dT%H:%M:%SZ
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
JOBS=${JOBS:-4}
# The recordings run in the background while the extension builds and the fixtures replay
# (JOBS replays at once): the ns/op figures of this run are indicative, not a benchmark.
stamp recordings-start
REC=$WORK/rec
mkdir -p "$REC"
(
  python3 "$HERE/record_user_snapshots.py" --out "$REC" --only resnet50_warm unet_wrapped \
    --alloc-conf expandable_segments:True > "$REC/user_driver.log" 2>&1 &
  python3 "$HERE/record_traces.py" --out "$REC" --alloc-conf expandable_segments:True \
    --timeout 150 > "$REC/traces_driver.log" 2>&1
  wait
) &
REC_PID=$!
stamp build
python3 "$HERE/pytorch_replay.py" --build || exit 1
stamp fixtures
python3 "$HERE/pytorch_replay.py" --batch "$WORK/pj/jobs.json" --out "$WORK/res/fixtures" \
  --repeat 5 --jobs "$JOBS" --timeout 90
tar czf "$OUT/fixtures.tgz" -C "$WORK/res" fixtures
stamp recordings-wait
wait $REC_PID
grep -v '^$' "$REC/traces_driver.log" | grep '^==\|entries\|ok,'
cat "$REC/user_driver.log"
tar czf "$OUT/recordings.tgz" -C "$WORK" rec
stamp export
python3 "$HERE/pytorch_replay_jobs.py" --cachalot "$WORK/bin/cachalot" --out "$WORK/pjx" \
  "$REC"/*.pickle "$REC"/*.pickle.gz
stamp expandable-replays
python3 "$HERE/pytorch_replay.py" --batch "$WORK/pjx/jobs.json" --out "$WORK/res/expandable" \
  --repeat 5 --jobs "$JOBS" --timeout 90
tar czf "$OUT/expandable_replays.tgz" -C "$WORK" pjx res/expandable
stamp done
