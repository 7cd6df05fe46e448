#!/usr/bin/env bash
# Mutation testing of a change (CI's step): the mutants of the policy core and of the model in
# the lines a commit range touches, run as scripts/mutants.sh runs them (same tests, same
# pinned seeds); fails when one survives.
#
#   scripts/mutants_ci.sh [BASE [TIP]]      default: the last commit (HEAD~1..HEAD)
#
#   MUTANTS_CI_MAX  at most this many mutants a crate (default 8; on 2 cores about 40 s each
#          for the allocator and 20 s for the model, after a first build of 3-5 minutes):
#          when the change has more, an evenly spread sample (shard k/n of
#          scripts/mutants.sh, k taken from the tip's hash so that successive commits sample
#          different ones) is run, and the output says so
#   OUT    folder for the results (default: a temporary folder, removed)
#
# A survivor is a rule nobody checks: write a test named for the rule that fails with the
# mutant put back by hand, or, if the mutant changes nothing the code does, argue it in
# results/mutants-2026-12-03/equivalent.md and add it to .cargo/mutants.toml's exclude_re.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
base=${1:-HEAD~1}
tip=${2:-HEAD}
max=${MUTANTS_CI_MAX:-8}
[[ $max =~ ^[0-9]+$ && $max -gt 0 ]] || { echo "MUTANTS_CI_MAX must be a positive number" >&2; exit 2; }
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
    echo "no commit $base (a shallow clone?): no change to mutate"
    exit 0
fi
if [[ $(git rev-parse "$tip") != $(git rev-parse HEAD) ]]; then
    echo "the tip must be the checked-out commit (cargo mutants mutates the working tree)" >&2
    exit 2
fi
command -v cargo-mutants >/dev/null || cargo install cargo-mutants --locked --version 27.1.0
out=${OUT:-}
keep=1
if [[ -z $out ]]; then out=$(mktemp -d); keep=0; fi
mkdir -p "$out"
diff=$out/change.diff
git diff "$base" "$tip" -- allocator/src model/src > "$diff"
failed=0
for crate in allocator model; do
    case $crate in allocator) pkg=cachalot ;; model) pkg=cachalot-model ;; esac
    n=$(cargo mutants --package "$pkg" --list --in-diff "$diff" 2>/dev/null | wc -l)
    if (( n == 0 )); then
        echo "== $crate: no mutant in the change"
        continue
    fi
    shard=""
    if (( n > max )); then
        parts=$(( (n + max - 1) / max ))
        k=$(( 16#$(git rev-parse --short=8 "$tip") % parts ))
        shard="$k/$parts"
        echo "== $crate: $n mutants in the change, more than $max: the sample $shard (one in $parts)"
    else
        echo "== $crate: $n mutants in the change"
    fi
    MUTANTS_IN_DIFF=$diff scripts/mutants.sh "$crate" "$shard" "$out/$crate" || true
    missed=$out/$crate/mutants.out/missed.txt
    if [[ -s $missed ]]; then
        failed=1
        echo "!! $crate: mutants no test catches:"
        sed 's/^/!!   /' "$missed"
    fi
    if [[ ! -f $out/$crate/summary.txt ]] || grep -q "cargo-mutants exit: [^023]" "$out/$crate/summary.txt"; then
        # 0: all caught; 2: some missed (reported above); 3: timeouts (caught); anything else: the run itself failed.
        failed=1
        echo "!! $crate: the mutation run did not complete (see $out/$crate)"
    fi
done
(( keep )) || rm -rf "$out"
if (( failed )); then
    echo "== a mutant survived or a run did not complete (see above; the script's header says what to do with a survivor)"
    exit 1
fi
echo "== every mutant of the change caught"
