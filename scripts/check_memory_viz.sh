#!/usr/bin/env bash
# Check that PyTorch's own snapshot tools accept memory snapshots (for example ones
# written by cachalot): runs `python -m torch.cuda._memory_viz` with its `stats`, `trace`,
# `segments`, `memory`, `trace_plot` and `segment_plot` commands on each FILE and fails on
# the first error. FILE may be gzip-compressed (*.gz).
#
# Seen passing on 2026-11-30 with PyTorch 2.11.0 for snapshots written by cachalot's
# write_snapshot (the re-written fixtures of tests/fixtures/traces and a hand-built one with
# pending and free blocks, an oom entry and two devices).
#
# usage: scripts/check_memory_viz.sh FILE [FILE ...]
#   PYTHON   python with torch installed (default: python3)
#   KEEP=DIR keep the outputs (stats.txt, trace.txt, *.svg, *.html) under DIR/<file name>/
#
# `segments` and `memory` pipe their collapsed stacks into flamegraph.pl, which
# _memory_viz looks for at ~/.cache/flamegraph.pl (PyTorch 2.11; /tmp/<uid>_flamegraph.pl in
# older releases) and downloads when it is missing. Where it is missing this script puts a
# small stand-in there for the duration of the run (it checks the "stack count" lines and
# writes a minimal SVG) and removes it afterwards, so nothing is downloaded and no network is
# needed.
set -euo pipefail

if [ "$#" -lt 1 ]; then
    echo "usage: $0 FILE [FILE ...]" >&2
    exit 2
fi

PY=${PYTHON:-python3}
work=$(mktemp -d)
stubs=()
cleanup() {
    rm -rf "$work"
    for s in "${stubs[@]}"; do rm -f "$s"; done
}
trap cleanup EXIT

cat >"$work/flamegraph-stub" <<'EOF'
#!/bin/sh
# stand-in for flamegraph.pl made by cachalot's scripts/check_memory_viz.sh
awk '
  /^$/ { next }
  !/^.+ -?[0-9]+$/ { print "bad flamegraph line: " $0 > "/dev/stderr"; bad = 1; next }
  { n++ }
  END {
    if (bad) exit 1
    printf "<svg xmlns=\"http://www.w3.org/2000/svg\"><text>%d stacks</text></svg>\n", n
  }'
EOF
chmod +x "$work/flamegraph-stub"
for flamegraph in "$HOME/.cache/flamegraph.pl" "/tmp/$(id -u)_flamegraph.pl"; do
    if [ ! -e "$flamegraph" ]; then
        mkdir -p "$(dirname "$flamegraph")"
        cp "$work/flamegraph-stub" "$flamegraph"
        stubs+=("$flamegraph")
    fi
done

viz() { "$PY" -W ignore::RuntimeWarning -m torch.cuda._memory_viz "$@"; }

for file in "$@"; do
    name=$(basename "$file")
    out="$work/out/$name"
    mkdir -p "$out"
    input="$file"
    case "$file" in
    *.gz)
        input="$out/snapshot.pickle"
        gzip -dc "$file" >"$input"
        ;;
    esac
    echo "== $file"
    viz stats "$input" >"$out/stats.txt"
    grep -q '^total_reserved:' "$out/stats.txt" || {
        echo "$file: stats printed no total_reserved line" >&2
        exit 1
    }
    viz trace "$input" >"$out/trace.txt"
    viz segments "$input" -o "$out/segments.svg"
    viz memory "$input" -o "$out/memory.svg"
    viz trace_plot "$input" -o "$out/trace_plot.html"
    viz segment_plot "$input" -o "$out/segment_plot.html"
    for f in segments.svg memory.svg trace_plot.html segment_plot.html; do
        [ -s "$out/$f" ] || {
            echo "$file: $f is empty" >&2
            exit 1
        }
    done
    sed -n '/^segments:/,/^total_free:/p' "$out/stats.txt"
    head -n 1 "$out/trace.txt"
    if [ -n "${KEEP:-}" ]; then
        mkdir -p "$KEEP/$name"
        cp "$out"/*.txt "$out"/*.svg "$out"/*.html "$KEEP/$name/"
    fi
done
echo "all $# snapshot(s) accepted by torch.cuda._memory_viz"
