#!/usr/bin/env bash
# The full mutation run, made of one run per source file, resumable (issue: prove the tests bite).
#
#   scripts/mutants_full.sh allocator|model OUTROOT [MAX_FILES]
#
# Asks scripts/mutants_ledger.py which of today's mutants have no outcome on today's source
# yet (or were missed: a test written since may kill them), and runs them file by file with
# scripts/mutants.sh (same tests, seeds and timeouts), each file's run in
# OUTROOT/<crate>/<file>-<time>/. Stop it at any point: the next call starts where the ledger
# says, counting the runs under OUTROOT and under results/mutants-*/. MAX_FILES stops after
# that many files. On the 2-core VM a mutant cost 25-51 s on average in the first files
# (results/mutants-2026-12-07: a build of 20-28 s with the cores shared, then 2.5 s of tests
# when the crate's own tests catch it, about 43 s when only the harness's do or it is missed),
# plus a first build of 2-3 minutes per file.
set -euo pipefail
crate=${1:?usage: scripts/mutants_full.sh allocator|model OUTROOT [MAX_FILES]}
outroot=${2:?usage: scripts/mutants_full.sh allocator|model OUTROOT [MAX_FILES]}
max=${3:-1000}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$outroot/$crate"
outroot=$(cd "$outroot" && pwd)
plan=$(python3 "$root/scripts/mutants_ledger.py" "$crate" --runs "$outroot" --remaining)
n=0
while IFS=$'\t' read -r file count regex; do
    [[ -n $file ]] || continue
    (( n < max )) || break
    n=$(( n + 1 ))
    slug=$(basename "$file" .rs)-$(date -u +%Y%m%dT%H%M%S)
    echo "== $file: $count mutants -> $outroot/$crate/$slug"
    MUTANTS_FILE=$file MUTANTS_RE=$regex "$root/scripts/mutants.sh" "$crate" "" "$outroot/$crate/$slug" \
        > "$outroot/$crate/$slug.log" 2>&1 || true
    tail -4 "$outroot/$crate/$slug.log"
done <<< "$plan"
python3 "$root/scripts/mutants_ledger.py" "$crate" --runs "$outroot"
