#!/usr/bin/env bash
# Mutation testing of the policy core and of the model (issue: prove the tests bite).
#
#   scripts/mutants.sh allocator|model [SHARD] [OUT]
#
#   SHARD  k/n: every n-th mutant from the k-th (round-robin over cargo-mutants' list, which is
#          sorted by file and line, so a sample spreads over every file); default: all of them
#   OUT    folder for the results (default results/mutants-$(date +%F)/<crate>)
#   MUTANTS_TIMEOUT  seconds one mutant's tests may run (default 120: the whole selection runs in
#          about 50 s on the 2-core VM when nothing fails, so one still running at 120 s is hung)
#   MUTANTS_IN_DIFF  a diff file: only the mutants in the lines it touches (cargo mutants
#          --in-diff; scripts/mutants_ci.sh makes one from a commit range)
#   MUTANTS_FILE, MUTANTS_RE  only the mutants of this source file (cargo mutants --file) whose
#          names match this regex (--re); scripts/mutants_full.sh runs the ones its ledger lacks
#
# What is mutated (.cargo/mutants.toml excludes the rest): for `allocator`, the policy core
# (allocator/src/policy/**: segments, expandable ranges, reclaim, adoption, aliasing, views),
# sizes, statistics, the free set, blocks, settings and their parser, the front end and the
# thread caches; not the CUDA and FFI layers, the simulated device, snapshots or history.
# For `model`, the whole of cachalot-model. The mutants argued equivalent
# (results/mutants-2026-12-03/equivalent.md) are left out by the same file's `exclude_re`.
#
# What is run for each mutant: the tests of the mutated crate and of cachalot-harness (the
# differential property tests, the named scenarios, the fuzz regressions, the replay of every
# fixture), without doc tests, and without the GPU tests (`gpu_*`: they skip without a GPU, so
# building them for every mutant bought nothing) and the loom models (empty unless built with
# `--cfg loom`). Built without debug information (CARGO_PROFILE_DEV_DEBUG=0; the optimisation
# levels of Cargo.toml stay, so the tests run as fast). On the 2-core VM an allocator mutant's
# build then takes 33 s (median of shard 2/48, 2026-12-07; 41 s with debug information and the
# GPU tests, shard 0/48): the allocator's own unit tests, the harness and four test binaries
# are compiled again at opt-level 2 for every mutant, and that, not the tests, is the time.
# Pinned: PROPTEST_RNG_SEED (the property tests draw the same cases on every run) and the
# tests' own case counts; PROPTEST_MAX_SHRINK_TIME stops shrinking a failure at once (a mutant
# is caught by the first failure, its minimal case is not needed).
#
# cargo-mutants 27.1 builds its baseline with the mutated package's tests only, whatever
# --test-package says (the mutants themselves do run the harness: see each mutant's log in
# mutants.out/log/), so its automatic timeout would be measured on the wrong tests: the
# baseline is skipped and the timeouts are given.
set -euo pipefail
crate=${1:?usage: scripts/mutants.sh allocator|model [SHARD] [OUT]}
shard=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${3:-$root/results/mutants-$(date +%F)/$crate}
case $crate in
    allocator) pkg=cachalot ;;
    model) pkg=cachalot-model ;;
    *) echo "unknown crate $crate (allocator or model)" >&2; exit 2 ;;
esac
command -v cargo-mutants >/dev/null || cargo install cargo-mutants --locked --version 27.1.0
# The test targets: every library's unit tests, and every integration test of the two
# packages but the GPU tests and the loom models (found by name, so a new test file is run).
tests=(--cargo-arg=--lib)
for f in "$root/${crate}/tests/"*.rs "$root/harness/tests/"*.rs; do
    [[ -e $f ]] || continue
    name=$(basename "$f" .rs)
    [[ $name == gpu_* || $name == loom_* ]] && continue
    tests+=("--cargo-arg=--test=$name")
done
args=(--package "$pkg" --test-package "$pkg,cachalot-harness" "${tests[@]}"
      --baseline skip --timeout "${MUTANTS_TIMEOUT:-120}" --build-timeout 900 --no-shuffle)
if [[ -n $shard ]]; then args+=(--shard "$shard" --sharding round-robin); fi
if [[ -n ${MUTANTS_IN_DIFF:-} ]]; then args+=(--in-diff "$MUTANTS_IN_DIFF"); fi
if [[ -n ${MUTANTS_FILE:-} ]]; then args+=(--file "$MUTANTS_FILE"); fi
if [[ -n ${MUTANTS_RE:-} ]]; then args+=(--re "$MUTANTS_RE"); fi
mkdir -p "$out"
export PROPTEST_RNG_SEED=${PROPTEST_RNG_SEED:-20261203} PROPTEST_MAX_SHRINK_TIME=1
export CARGO_PROFILE_DEV_DEBUG=${CARGO_PROFILE_DEV_DEBUG:-0}
start=$(date +%s)
cd "$root"
header="crate: $pkg   shard: ${shard:-all}${MUTANTS_IN_DIFF:+   in diff: $MUTANTS_IN_DIFF}${MUTANTS_FILE:+   file: $MUTANTS_FILE}   date: $(date -u +%FT%TZ)   commit: $(git rev-parse --short HEAD)"
# Written first, so that a run stopped halfway still says what it ran on (the ledger reads
# its outcomes so far); replaced at the end.
echo "$header   (running)" > "$out/summary.txt"
rc=0
cargo mutants "${args[@]}" --output "$out" || rc=$?
elapsed=$(( $(date +%s) - start ))
m=$out/mutants.out
count() { [[ -f $m/$1 ]] && wc -l < "$m/$1" || echo 0; }
caught=$(count caught.txt) missed=$(count missed.txt) timeout=$(count timeout.txt) unviable=$(count unviable.txt)
viable=$(( caught + missed + timeout ))
{
    echo "$header"
    echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
    echo "run time: ${elapsed} s   cargo-mutants exit: $rc"
    echo "caught $caught, timeout $timeout, missed $missed, unviable $unviable"
    if (( viable > 0 )); then
        echo "score (caught + timeout) / viable: $(( (caught + timeout) * 1000 / viable / 10 )).$(( (caught + timeout) * 1000 / viable % 10 )) %"
    fi
} | tee "$out/summary.txt"
