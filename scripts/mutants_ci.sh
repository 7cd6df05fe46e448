#!/usr/bin/env bash
# Mutation testing of a change (CI's step): every mutant of the policy core and of the model in
# the lines a commit range touches, run as scripts/mutants_schemata.py runs them (one build of
# the change's mutants as switches, then each mutant's tests: the same tests and pinned seeds
# as scripts/mutants.sh); fails when one survives.
#
#   scripts/mutants_ci.sh [BASE [TIP]]      default: the last commit (HEAD~1..HEAD)
#
#   MUTANTS_CI_MAX  at most this many of the mutants a switch cannot hold (a `const`, an `impl
#          Trait` return, a let chain: scripts/mutants_schemata.py's fallback), which
#          cargo-mutants builds one by one (about 40 s each on 2 cores); default 8, an evenly
#          spread sample when there are more. Every other mutant of the change is run.
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
    echo "== $crate"
    python3 scripts/mutants_schemata.py "$crate" --in-diff "$diff" --out "$out/$crate" \
        --work "$out/work" --target-dir "$out/work/target" --fallback "$max" --fail-on-missed \
        || failed=1
    for missed in "$out/$crate/missed.txt" "$out/$crate/fallback/mutants.out/missed.txt"; do
        if [[ -s $missed ]]; then
            echo "!! $crate: mutants no test catches:"
            sed 's/^/!!   /' "$missed"
        fi
    done
done
(( keep )) || rm -rf "$out"
if (( failed )); then
    echo "== a mutant survived or a run did not complete (see above; the script's header says what to do with a survivor)"
    exit 1
fi
echo "== every mutant of the change caught"
