#!/usr/bin/env python3
"""The ledger of a full mutation run, gathered from many shorter runs (issue: prove the tests bite).

    scripts/mutants_ledger.py allocator|model [--runs DIR ...] [--remaining] [--markdown FILE]

A full run of either crate takes longer than one working session on the 2-core VM, so it is
made of runs of a file or a shard each (scripts/mutants.sh, scripts/mutants_full.sh). This
script lists today's mutants (`cargo mutants --list`, so .cargo/mutants.toml's exclusions
hold) and, for each, the outcome of the latest run that tested it *on today's source file*: a
run counts for a mutant only if the mutated file is the same at the run's commit as in the
working tree but for its trailing unit-test module (`#[cfg(test)] mod tests { ... }` at the
end, which cargo-mutants does not mutate: tests added there move no mutant), since a mutant's
name holds its line and column. Runs are found under results/mutants-*/ and the folders given with --runs: every
folder with a summary.txt (scripts/mutants.sh writes it: crate, commit, date) and the
caught/missed/timeout/unviable lists beside it or in its mutants.out/.

Prints, per file, how many mutants are caught, timed out (counted as caught: a hang),
missed, unviable and not yet tested, and the score (caught + timeout) / viable of the tested
ones. --remaining prints instead one line per file with mutants not tested or missed (a
missed one is run again: a test written since may kill it): the file, a tab, their number, a tab, and a regex
matching exactly their names (for cargo mutants --re).
"""
import argparse
import glob
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"allocator": "cachalot", "model": "cachalot-model"}
OUTCOMES = ("caught", "timeout", "missed", "unviable")


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def current_mutants(pkg):
    r = subprocess.run(["cargo", "mutants", "--list", "--package", pkg], cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"cargo mutants --list failed:\n{r.stderr}")
    return [l for l in r.stdout.splitlines() if l.strip()]


def parse_summary(path):
    head = open(path).readline()

    def field(key):
        m = re.search(rf"(?:^|\s){key}:\s+(\S+)", head)
        return m.group(1) if m else None

    return field("crate"), field("commit"), field("date") or ""


def runs(extra):
    dirs = {os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "results", "mutants-*", "**",
                                                               "summary.txt"), recursive=True)}
    for d in extra:
        dirs |= {os.path.dirname(p) for p in glob.glob(os.path.join(d, "**", "summary.txt"),
                                                        recursive=True)}
    for d in sorted(dirs):
        crate, commit, date = parse_summary(os.path.join(d, "summary.txt"))
        lists = d if os.path.exists(os.path.join(d, "caught.txt")) else os.path.join(d, "mutants.out")
        if not commit or not os.path.exists(os.path.join(lists, "caught.txt")):
            continue
        yield crate, commit, date, d, lists


# The module may be kept off for loom (`#[cfg(all(test, not(loom)))]`) and say why above it.
TESTS = re.compile(
    r"\n(?://[^\n]*\n)*#\[cfg\((?:test|all\(test, not\(loom\)\))\)\]\nmod tests \{\n.*\Z", re.S)


def without_tests(source):
    """The source without its trailing unit-test module: cargo-mutants mutates no test code,
    and a change there alone moves no mutant (the tests only get more), so runs made before it
    still count. Any other change to the file voids them."""
    return TESTS.sub("\n", source)


def rust_escape(s):
    # regex::escape's set: `\<` is not an escape but a word boundary in Rust's regex syntax, so
    # Python's re.escape would not do.
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crate", choices=PACKAGES)
    ap.add_argument("--runs", nargs="*", default=[], help="more folders holding runs")
    ap.add_argument("--remaining", action="store_true")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--agreement", action="store_true")
    a = ap.parse_args()
    pkg = PACKAGES[a.crate]
    names = current_mutants(pkg)
    wanted = set(names)
    same_cache = {}

    def same(commit, path):
        key = (commit, path)
        if key not in same_cache:
            then = git("show", f"{commit}:{path}")
            try:
                now = open(os.path.join(ROOT, path)).read()
            except OSError:
                now = None
            same_cache[key] = (then.returncode == 0 and now is not None
                               and without_tests(then.stdout) == without_tests(now))
        return same_cache[key]

    outcome = {}  # name -> (date, outcome, run folder)
    every = defaultdict(list)  # name -> [(schemata?, outcome, run folder)]
    for crate, commit, date, d, lists in runs(a.runs):
        if crate != pkg:
            continue
        for o in OUTCOMES:
            p = os.path.join(lists, f"{o}.txt")
            if not os.path.exists(p):
                continue
            for line in open(p):
                name = line.rstrip("\n")
                if name not in wanted or not same(commit, name.split(":", 1)[0]):
                    continue
                every[name].append(("schemata" in open(os.path.join(d, "summary.txt")).readline(),
                                    o, os.path.relpath(d, ROOT)))
                if name not in outcome or outcome[name][0] <= date:
                    outcome[name] = (date, o, os.path.relpath(d, ROOT))

    by_file = defaultdict(Counter)
    todo = defaultdict(list)
    for n in names:
        f = n.split(":", 1)[0]
        o = outcome.get(n, (None, "untested", None))[1]
        by_file[f][o] += 1
        if o in ("untested", "missed"):
            todo[f].append(n)

    if a.agreement:
        same_class = {"caught": "caught", "timeout": "caught", "missed": "missed",
                      "unviable": "unviable"}
        agree, differ = 0, []
        for n, rs in sorted(every.items()):
            sch = {same_class[o] for s, o, _ in rs if s}
            cm = {same_class[o] for s, o, _ in rs if not s}
            if not sch or not cm:
                continue
            if sch & cm:
                agree += 1
            else:
                differ.append((n, rs))
        print(f"tested both ways: {agree + len(differ)}; same outcome: {agree}; "
              f"different: {len(differ)}")
        for n, rs in differ:
            print(f"  {n}: " + "; ".join(f"{o} ({d})" for _, o, d in rs))
        return

    if a.remaining:
        for f, ns in todo.items():
            print(f"{f}\t{len(ns)}\t^(?:{'|'.join(rust_escape(n) for n in ns)})$")
        return

    cols = ("caught", "timeout", "missed", "unviable", "untested")
    rows = [f"| file | mutants | {' | '.join(cols)} | score of the tested |",
            "|---|---:|" + "---:|" * len(cols) + "---:|"]
    total = Counter()
    for f in sorted(by_file):
        c = by_file[f]
        total += c
        rows.append(f"| {f} | {sum(c.values())} | " + " | ".join(str(c[k]) for k in cols)
                    + f" | {score(c)} |")
    rows.append(f"| **all** | {sum(total.values())} | " + " | ".join(str(total[k]) for k in cols)
                + f" | {score(total)} |")
    text = "\n".join(rows)
    print(text)
    missed = sorted(n for n, v in outcome.items() if v[1] == "missed")
    if missed:
        print("\nmissed:")
        for n in missed:
            print(f"  {n}   ({outcome[n][2]})")
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(text + "\n")


def score(c):
    viable = c["caught"] + c["timeout"] + c["missed"]
    return f"{100 * (c['caught'] + c['timeout']) / viable:.1f} %" if viable else "–"


if __name__ == "__main__":
    main()
