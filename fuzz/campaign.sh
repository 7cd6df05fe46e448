#!/usr/bin/env bash
# A fuzz campaign: builds every target and runs each for TARGET_SECONDS with JOBS processes,
# then prints executions, executions per second, corpus size and every crash with the command
# that reproduces it. Exits 1 when any target crashed (or hung, or ran out of memory).
#
#   fuzz/campaign.sh TARGET_SECONDS [JOBS]
#
# Environment:
#   TARGETS    targets to run, space-separated (default: all four, fastest first)
#   SANITIZER  cargo fuzz's -s (default none: the code under test is safe Rust, and without a
#              sanitizer stable Rust builds it; 'address' needs a nightly toolchain)
#   FUZZ_ARGS  extra libFuzzer flags for every target (e.g. -max_len=8192)
#   NO_TRACE_COMPARES  targets built without libFuzzer's comparison tracing (cargo fuzz
#              --no-trace-compares, in fuzz/target/no-trace-compares/; default: the two allocator
#              targets, whose comparisons are mostly the checks' own and cost them 2-2.5x their
#              speed; see fuzz/README.md, "Speed"); '' traces every target's comparisons
#   JOBS_<target>  that target's process count instead of JOBS (e.g. JOBS_differential=40)
#   CONCURRENT=1  every target at the same time (each with its own processes) instead of one
#              after the other: for a many-core host
#   PREBUILT=DIR  no build (and no cargo needed): the four target binaries are in DIR, built
#              before with this script's flags (for a host without Rust: see fuzz/README.md)
#
# Route (see fuzz/README.md): cargo-fuzz (installed here if missing) on the stable toolchain
# with RUSTC_BOOTSTRAP=1, which cargo-fuzz needs for its -Z flags; no nightly required.
# Working corpora go to fuzz/corpus/<target>/ (kept between campaigns, not committed; the
# committed seeds in fuzz/seeds/<target>/ are read as a second corpus), crashes to
# fuzz/artifacts/<target>/, libFuzzer's logs to fuzz/logs/<target>/.
set -euo pipefail

usage() { echo "usage: $0 TARGET_SECONDS [JOBS]" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 && $1 =~ ^[0-9]+$ && $1 -gt 0 ]] || usage
SECONDS_PER_TARGET=$1
JOBS=${2:-1}
[[ $JOBS =~ ^[0-9]+$ && $JOBS -gt 0 ]] || usage
TARGETS=${TARGETS:-"settings_parser snapshot_reader device_faults differential"}
SANITIZER=${SANITIZER:-none}
NO_TRACE_COMPARES=${NO_TRACE_COMPARES-"differential device_faults"}

# A relative PREBUILT is read from where the script was started.
if [[ -n ${PREBUILT:-} ]]; then PREBUILT=$(cd "$PREBUILT" && pwd); fi
FUZZ=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$FUZZ")
cd "$FUZZ"

NO_TC_DIR="$FUZZ/target/no-trace-compares"
untraced() { [[ " $NO_TRACE_COMPARES " == *" $1 "* ]]; }
if [[ -n ${PREBUILT:-} ]]; then
    echo "== prebuilt binaries in $PREBUILT (no build)"
    bin_dir() { echo "$PREBUILT"; }
else
    export RUSTC_BOOTSTRAP=1
    if ! cargo fuzz --version >/dev/null 2>&1; then
        echo "== installing cargo-fuzz"
        cargo install cargo-fuzz --locked
    fi

    echo "== building (sanitizer: $SANITIZER)"
    cargo fuzz build -s "$SANITIZER"
    BIN="$FUZZ/target/x86_64-unknown-linux-gnu/release"
    for t in $TARGETS; do
        if untraced "$t"; then
            echo "== building $t without comparison tracing"
            cargo fuzz build -s "$SANITIZER" --no-trace-compares --target-dir "$NO_TC_DIR" "$t"
        fi
    done
    # The binary a target runs.
    bin_dir() {
        if untraced "$1"; then echo "$NO_TC_DIR/x86_64-unknown-linux-gnu/release"; else echo "$BIN"; fi
    }
fi

# Per-target libFuzzer flags.
target_flags() {
    case $1 in
        settings_parser) echo "-dict=$FUZZ/settings.dict -max_len=512" ;;
        # Real snapshots are larger, but mutations of a 32 KiB prefix reach every opcode and
        # every field; the full fixtures are replayed by the test suite.
        snapshot_reader) echo "-max_len=32768" ;;
        # MAX_OPS operations of at most ~16 bytes each.
        differential | device_faults) echo "-max_len=4096" ;;
    esac
}

# One target's campaign: its summary line goes to fuzz/logs/<target>/summary.txt; returns 1
# when it crashed.
run_target() {
    local t=$1 bin corpus artifacts logs extra fixtures before start elapsed execs rss files
    local bytes rate line new crashed=0
    local jobs_var="JOBS_$t"
    local jobs=${!jobs_var:-$JOBS}
    bin=$(bin_dir "$t")
    [[ -x $bin/$t ]] || { echo "unknown target $t" >&2; exit 2; }
    corpus=$FUZZ/corpus/$t
    artifacts=$FUZZ/artifacts/$t
    logs=$FUZZ/logs/$t
    mkdir -p "$corpus" "$artifacts" "$logs"
    rm -f "$logs"/fuzz-*.log "$logs/summary.txt"
    extra=()
    if [[ $t == snapshot_reader ]]; then
        # The recorded snapshots small enough for -max_len, beside the committed seeds.
        fixtures=$FUZZ/corpus/.snapshot_fixtures
        mkdir -p "$fixtures"
        find "$ROOT/tests/fixtures" -name '*.pickle' -size -32k -exec cp {} "$fixtures/" \;
        extra=("$fixtures")
    fi
    before=$(ls "$artifacts" | wc -l)
    echo "== $t: $SECONDS_PER_TARGET s, $jobs job(s)"
    start=$(date +%s)
    # -jobs/-workers: JOBS processes, each fuzzing for the whole time and sharing the corpus.
    (cd "$logs" && "$bin/$t" "$corpus" "$FUZZ/seeds/$t" "${extra[@]}" \
        -max_total_time="$SECONDS_PER_TARGET" -jobs="$jobs" -workers="$jobs" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" $(target_flags "$t") ${FUZZ_ARGS:-} \
        >"$logs/driver.log" 2>&1) || true
    elapsed=$(( $(date +%s) - start ))
    execs=$(cat "$logs"/fuzz-*.log 2>/dev/null | awk '/stat::number_of_executed_units/ {s += $2} END {print s + 0}')
    rss=$(cat "$logs"/fuzz-*.log 2>/dev/null | awk '/stat::peak_rss_mb/ {if ($2 > m) m = $2} END {print m + 0}')
    files=$(ls "$corpus" | wc -l)
    bytes=$(( $(find "$corpus" -type f -printf "%s\n" | awk "{s += \$1} END {print s + 0}") / 1024 ))
    rate=$(( execs / (elapsed > 0 ? elapsed : 1) ))
    line=$(printf '%-16s %12s execs  %8s exec/s  %6s s  corpus %6s files %7s KiB  peak RSS %5s MB' \
        "$t" "$execs" "$rate" "$elapsed" "$files" "$bytes" "$rss")
    new=$(( $(ls "$artifacts" | wc -l) - before ))
    if (( new > 0 )) || grep -qs -e '^==[0-9]*== ERROR: libFuzzer' -e 'panicked at' "$logs"/fuzz-*.log; then
        crashed=1
        line+="  CRASHED"
        echo "!! $t found a crash; log excerpts:"
        grep -hs -A12 -e 'panicked at' -e 'ERROR: libFuzzer' "$logs"/fuzz-*.log | head -60 || true
        for a in $(ls -t "$artifacts" | head -n "$(( new > 0 ? new : 1 ))"); do
            echo "!! reproduce:  cd $FUZZ && RUSTC_BOOTSTRAP=1 cargo fuzz run -s $SANITIZER $t artifacts/$t/$a"
            echo "!!    or:      $bin/$t $artifacts/$a"
            echo "!! keep it:    cp $artifacts/$a $FUZZ/regressions/$t/  (then cargo test -p cachalot-harness --test fuzz_corpus)"
        done
    fi
    echo "$line" > "$logs/summary.txt"
    return $crashed
}

crashed=0
summary=()
if [[ ${CONCURRENT:-} == 1 ]]; then
    mkdir -p "$FUZZ/logs"
    pids=()
    for t in $TARGETS; do
        run_target "$t" > "$FUZZ/logs/$t.out" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || crashed=1; done
    for t in $TARGETS; do cat "$FUZZ/logs/$t.out"; done
else
    for t in $TARGETS; do run_target "$t" || crashed=1; done
fi
for t in $TARGETS; do
    summary+=("$(cat "$FUZZ/logs/$t/summary.txt" 2>/dev/null || echo "$t: did not run")")
done

echo
echo "== summary ($SECONDS_PER_TARGET s per target)"
printf '%s\n' "${summary[@]}"
if (( crashed )); then
    echo "== crash found"
    exit 1
fi
echo "== no crash"
