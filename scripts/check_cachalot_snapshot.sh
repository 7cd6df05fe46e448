#!/usr/bin/env bash
# Check that PyTorch's own tools read snapshots written by the `cachalot` binary: replays a
# few committed traces with `cachalot replay --pytorch --snapshot-out` (a training step with
# many segments, a two-stream trace with cross-stream frees, a trace with an out-of-memory
# entry) and runs scripts/check_memory_viz.sh (`python -m torch.cuda._memory_viz` stats,
# trace, segments, memory, trace_plot and segment_plot) on the results and on any extra
# snapshot FILEs given (e.g. GPU replays from scripts/gpu_agreement.sh).
#
# usage: scripts/check_cachalot_snapshot.sh [FILE ...]
#   CACHALOT  the binary (default .gpu/bin/cachalot, else target/release/cachalot)
#   PYTHON    python with torch installed (default python3); KEEP=DIR keeps the outputs
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${CACHALOT:-}
if [ -z "$bin" ]; then
    if [ -x .gpu/bin/cachalot ]; then bin=.gpu/bin/cachalot; else bin=target/release/cachalot; fi
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for name in gpt2_train two_stream fraction_oom_retry; do
    "$bin" replay "tests/fixtures/traces/$name.pickle" --pytorch \
        --snapshot-out "$work/cachalot_$name.pickle" >/dev/null
done
"$here/check_memory_viz.sh" "$work"/cachalot_*.pickle "$@"
