#!/usr/bin/env python3
"""The full mutation run in one build per crate: mutant schemata (issue: prove the tests bite).

    scripts/mutants_schemata.py allocator|model [--out DIR] [--work DIR] [--remaining]
                                [--in-diff DIFF] [--names FILE] [--target-dir DIR] [--timeout S] [--limit N] [--fallback [N]]
                                [--fail-on-missed]

cargo-mutants builds each mutant on its own, and on the 2-core VM that build (25-50 s: the
crate's unit tests, the harness and its test binaries, at opt-level 2) is most of a mutant's
cost; its tests are a few seconds when they catch it. Here every mutant of `cargo mutants
--list` (so .cargo/mutants.toml's exclusions hold) is written into a copy of the crate at once,
each behind a switch read at run time (tools/mutants-schemata), the tests are built once, and
each mutant is then the same test selection as scripts/mutants.sh's (the crate's and the
harness's unit and integration tests but the GPU tests and loom models, PROPTEST_RNG_SEED
pinned, no shrinking) run with its number in the environment.

1. The copy is HEAD's tree (`git archive`): the crate's sources must be committed.
2. The compiler's errors are traced to the mutants they lie in, which are left out, and the
   copy is built again. A mutant whose own changed text does not compile (a `Default::default()`
   of a type without one) is unviable, as cargo-mutants would find it. One whose switch does
   not (in a `const`), and one the tool does not place (an `impl Trait` return, a let chain),
   are listed in fallback.txt and run with cargo-mutants (scripts/mutants.sh, one build each)
   when --fallback is given.
3. The tests are run once with no mutant: they must pass.
4. Each mutant: caught (the tests fail), missed (they pass), timeout (still running after
   --timeout s, default 120: the whole selection takes about 50 s, or past 5 times an
   executable's own time with no mutant plus 20 s, cargo-mutants' rule applied to each
   executable, so a hang in a unit test is found in seconds). The test executables are
   run directly, one after another, stopping at the first that fails, and the one that caught
   the last mutant goes first (a function's mutants are mostly caught by the same tests).
   Each test process may use at most MUTANTS_MEMORY_GIB (6) GiB of address space: a mutant
   that allocates without end fails there (caught) instead of taking the machine's memory.
   The lists and summary.txt are those of scripts/mutants.sh, written as the run goes, so
   scripts/mutants_ledger.py counts a run stopped halfway.

--remaining runs only the mutants the ledger has no outcome for on today's sources (and its
missed ones, again); --names FILE only the mutants named in FILE; --in-diff only those in the
lines a diff touches (cargo mutants --in-diff: scripts/mutants_ci.sh); --limit N stops after N mutants; --fallback N runs at most N
of the fallback mutants (an evenly spread sample when there are more); --fail-on-missed exits
with 1 when a mutant survives (in either part).

One difference from cargo-mutants, by design: an operator is replaced in the expression tree,
where cargo-mutants' changed text is parsed again (`(a - b) + c` with `+` -> `*` is `(a - b) *
c` here, `a - b * c` there); the two differ only where the operators' precedences differ.
"""
import argparse
import bisect
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"allocator": ("cachalot", "CACHALOT_MUTANT"),
            "model": ("cachalot-model", "CACHALOT_MODEL_MUTANT")}
TOOL_DIR = os.path.join(ROOT, "tools", "mutants-schemata")


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def test_selection(crate):
    """scripts/mutants.sh's: unit tests, and the integration tests of the crate and the harness
    but gpu_* and loom_*."""
    args = ["--lib"]
    for d in (crate, "harness"):
        tdir = os.path.join(ROOT, d, "tests")
        for f in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
            name, ext = os.path.splitext(f)
            if ext == ".rs" and not name.startswith(("gpu_", "loom_")):
                args += ["--test", name]
    return args


def extract(tree, paths):
    """HEAD's version of `paths` into `tree`."""
    archive = subprocess.run(["git", "archive", "HEAD", *paths], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)


def error_ids(messages, ranges):
    """The mutants the compile errors lie in: those whose own changed text holds an error
    (unviable: cargo-mutants' build of the same text in the same place fails too), those whose
    switch does (left out, for cargo-mutants), and the errors in no mutant's code."""
    index = {f: sorted(r, key=lambda x: (x[0], -x[1])) for f, r in ranges.items()}
    unviable, switch, stray = set(), set(), []
    for m in messages:
        if m.get("reason") != "compiler-message" or m["message"]["level"] != "error":
            continue
        spans = m["message"]["spans"]
        found = False
        for s in spans:
            rs = index.get(s["file_name"])
            if not rs:
                continue
            inside = [r for r in rs if r[0] <= s["byte_start"] < max(r[1], r[0] + 1)]
            if inside:
                best = min(inside, key=lambda r: r[1] - r[0])
                (unviable if best[3] else switch).update(best[2])
                found = True
                break
        if not found and spans:
            stray.append(m["message"]["rendered"])
    return unviable, switch, stray


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crate", choices=PACKAGES)
    ap.add_argument("--out", help="results folder (default results/mutants-DATE/schemata/CRATE)")
    ap.add_argument("--work", default="/tmp/mutants-schemata", help="scratch folder")
    ap.add_argument("--remaining", action="store_true")
    ap.add_argument("--timeout", type=int, default=int(os.environ.get("MUTANTS_TIMEOUT", 120)))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--in-diff")
    ap.add_argument("--names", help="a file of mutant names, one a line: only these (say, the "
                    "ledger's survivors, run again after tests were written for them)")
    ap.add_argument("--target-dir", help="cargo's target folder (default: in the scratch folder, "
                    "one per crate, so that two crates can run at once)")
    ap.add_argument("--fallback", nargs="?", type=int, const=-1, default=None)
    ap.add_argument("--fail-on-missed", action="store_true")
    a = ap.parse_args()
    pkg, var = PACKAGES[a.crate]
    date = time.strftime("%Y-%m-%d")
    out = a.out or os.path.join(ROOT, "results", f"mutants-{date}", "schemata", a.crate)
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", f"{a.crate}/src"],
                      cwd=ROOT).returncode != 0:
        sys.exit(f"{a.crate}/src has uncommitted changes: the run is of HEAD's sources")
    commit = sh(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                capture_output=True).stdout.strip()
    work = os.path.join(a.work, a.crate)
    tree = os.path.join(work, "tree")
    os.makedirs(work, exist_ok=True)
    if shutil.which("cargo-mutants") is None:
        sh(["cargo", "install", "cargo-mutants", "--locked", "--version", "27.1.0"])
    listing = os.path.join(work, "list.json")
    with open(listing, "w") as f:
        diff = ["--in-diff", os.path.abspath(a.in_diff)] if a.in_diff else []
        sh(["cargo", "mutants", "--list", "--json", "--package", pkg, *diff], cwd=ROOT,
           stdout=f)
    # With --in-diff and nothing to mutate, cargo-mutants prints nothing at all.
    text = open(listing).read().strip()
    mutants = json.loads(text) if text else []
    names = [m["name"] for m in mutants]
    if not mutants:
        print(f"{a.crate}: no mutant")
        return 0

    wanted = set(range(len(mutants)))
    if a.remaining:
        r = sh([sys.executable, os.path.join(ROOT, "scripts", "mutants_ledger.py"), a.crate,
                "--remaining"], capture_output=True)
        res = [re.compile(line.split("\t")[2]) for line in r.stdout.splitlines() if line.strip()]
        wanted = {i for i, n in enumerate(names) if any(x.fullmatch(n) for x in res)}

    if a.names:
        named = {l.strip() for l in open(a.names) if l.strip()}
        wanted = {i for i in wanted if names[i] in named}
    if not wanted:
        print(f"{a.crate}: every mutant has an outcome")
        return 0

    # Build the schemata, leaving out what does not compile.
    sh(["cargo", "build", "--release", "--locked", "--quiet", "--manifest-path",
        os.path.join(TOOL_DIR, "Cargo.toml")])
    tool = os.path.join(TOOL_DIR, "target", "release", "mutants-schemata")
    if os.path.isdir(tree):
        shutil.rmtree(tree)
    os.makedirs(tree)
    extract(tree, ["."])
    env = dict(os.environ, CARGO_TARGET_DIR=a.target_dir or os.path.join(work, "target"),
               CARGO_PROFILE_DEV_DEBUG="0", PROPTEST_RNG_SEED=os.environ.get(
                   "PROPTEST_RNG_SEED", "20261203"), PROPTEST_MAX_SHRINK_TIME="1")
    env.pop(var, None)
    selection = ["-p", pkg, "-p", "cachalot-harness", *test_selection(a.crate)]
    disabled, unviable = set(), set()
    disable_file = os.path.join(work, "disabled.txt")
    mapf = os.path.join(work, "map.json")
    build_start = time.time()
    for attempt in range(30):
        shutil.rmtree(os.path.join(tree, a.crate, "src"))
        extract(tree, [f"{a.crate}/src"])
        with open(disable_file, "w") as f:
            f.write("\n".join(map(str, sorted(disabled))))
        sh([tool, "--list", listing, "--root", tree, "--env", var, "--map", mapf,
            "--disable", disable_file])
        cmap = json.load(open(mapf))
        r = subprocess.run(["cargo", "test", "--no-run", "--message-format=json", *selection],
                           cwd=tree, env=env, capture_output=True, text=True)
        msgs = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
        if r.returncode == 0:
            # The test executables, each with its package's folder (cargo runs a test there).
            binaries = [(f"{m['target']['name']} ({m['package_id'].split('#')[0].split('/')[-1]})",
                         m["executable"], os.path.dirname(m["manifest_path"]))
                        for m in msgs if m.get("reason") == "compiler-artifact"
                        and m.get("executable") and m["profile"]["test"]]
            break
        bad, switch, stray = error_ids(msgs, cmap["ranges"])
        if not bad and not switch:
            sys.exit("the schemata do not build, and not in a mutant's code:\n"
                     + "\n".join(stray[:5]) + r.stderr[-3000:])
        print(f"build {attempt + 1}: {len(bad)} mutants unviable (their own text does not "
              f"compile), {len(switch)} whose switch does not: left out", flush=True)
        unviable |= bad
        disabled |= bad | switch
    else:
        sys.exit("the schemata still do not build after 30 attempts")
    build_s = time.time() - build_start
    fallback = sorted((disabled - unviable) | set(cmap["unplaced"]))

    child = []

    def stop(signum, _frame):
        # A run stopped by hand takes its tests with it (they run in a session of their own).
        for p in child:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    # Each mutant runs the test executables themselves, one after another, stopping at the first
    # that fails (as `cargo test` does, without its start-up and its replay of the build's
    # warnings), the one that caught the last mutant first: a function's mutants are mostly
    # caught by the same tests, so the binary that catches is usually the first one run.
    order = list(range(len(binaries)))
    # Each executable's time with no mutant; a mutant's run of it is a timeout past 5 times
    # that plus 20 s (cargo-mutants' rule for the whole run, applied to each executable, so a
    # hang in a test of a fraction of a second costs 20 s, not --timeout).
    base = [None] * len(binaries)

    def limit_memory():
        # A mutant that makes a test allocate without end (a page size of 0, a loop that
        # never stops growing a vector) fails at this bound instead of taking the machine's
        # memory from the other run; no test needs near this much.
        gib = int(os.environ.get("MUTANTS_MEMORY_GIB", "6"))
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))

    def run_tests(mutant):
        e = dict(env)
        if mutant is not None:
            e[var] = str(mutant)
        t = time.time()
        log = []
        for b in list(order):
            name, exe, cwd = binaries[b]
            left = a.timeout - (time.time() - t)
            if base[b] is not None:
                left = min(left, 5 * base[b] + 20)
            if left <= 0:
                return None, time.time() - t, "".join(log)
            started = time.time()
            p = subprocess.Popen([exe, "--quiet"], cwd=cwd, env=dict(e, CARGO_MANIFEST_DIR=cwd),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True, preexec_fn=limit_memory)
            child[:] = [p]
            try:
                out_, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out_, _ = p.communicate()
                log.append(f"== {name}: still running after {left:.0f} s\n{out_}")
                return None, time.time() - t, "".join(log)
            log.append(f"== {name}: exit {p.returncode}\n{out_}")
            if mutant is None:
                base[b] = time.time() - started
            if p.returncode != 0:
                if mutant is not None:
                    order.remove(b)
                    order.insert(0, b)
                return p.returncode, time.time() - t, "".join(log)
        return 0, time.time() - t, "".join(log)

    rc, base_s, log = run_tests(None)
    if rc != 0:
        sys.exit(f"the tests fail with no mutant switched on (rc {rc}):\n{log[-3000:]}")

    os.makedirs(out, exist_ok=True)
    logs = os.path.join(work, "log")
    os.makedirs(logs, exist_ok=True)
    header = (f"crate: {pkg}   shard: schemata{'-remaining' if a.remaining else ''}   "
              f"date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}   commit: {commit}")
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(header + "   (running)\n")
    lists = {o: open(os.path.join(out, f"{o}.txt"), "w") for o in
             ("caught", "missed", "timeout", "unviable")}
    with open(os.path.join(out, "fallback.txt"), "w") as f:
        f.write("".join(names[i] + "\n" for i in fallback if i in wanted))
    lists["unviable"].write("".join(names[i] + "\n" for i in sorted(unviable) if i in wanted))
    lists["unviable"].flush()
    times = open(os.path.join(out, "times.tsv"), "w")
    times.write("mutant\toutcome\tseconds\n")
    todo = [i for i in sorted(wanted) if i not in set(fallback) and i not in unviable]
    if a.limit is not None:
        todo = todo[:a.limit]
    counts = {o: 0 for o in lists}
    start = time.time()
    for n, i in enumerate(todo):
        rc, s, log = run_tests(i)
        outcome = "timeout" if rc is None else "missed" if rc == 0 else "caught"
        counts[outcome] += 1
        lists[outcome].write(names[i] + "\n")
        lists[outcome].flush()
        times.write(f"{names[i]}\t{outcome}\t{s:.1f}\n")
        times.flush()
        if outcome != "caught":
            with open(os.path.join(logs, f"{i}.log"), "w") as f:
                f.write(log)
        print(f"[{n + 1}/{len(todo)}] {outcome:7} {s:5.1f} s  {names[i]}", flush=True)
    elapsed = time.time() - start
    for f in lists.values():
        f.close()
    viable = counts["caught"] + counts["missed"] + counts["timeout"]
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip()
    summary = [
        header,
        f"machine: {os.cpu_count()} cores, {cpu}",
        f"schemata build: {build_s:.0f} s ({len(unviable)} unviable, {len(disabled - unviable)} "
        f"whose switch does not compile and {len(cmap['unplaced'])} not placed: "
        f"fallback.txt)   tests with no mutant: {base_s:.1f} s",
        f"run time: {elapsed:.0f} s for {len(todo)} mutants "
        f"({elapsed / max(len(todo), 1):.1f} s each)",
        f"caught {counts['caught']}, timeout {counts['timeout']}, missed {counts['missed']}, "
        f"unviable {len([i for i in unviable if i in wanted])}",
    ]
    if viable:
        summary.append(f"score (caught + timeout) / viable: "
                       f"{100 * (counts['caught'] + counts['timeout']) / viable:.1f} %")
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    print("\n".join(summary))
    missed = counts["missed"]
    todo_names = [names[i] for i in fallback if i in wanted]
    if a.fallback is not None and todo_names:
        if 0 < a.fallback < len(todo_names):
            step = len(todo_names) / a.fallback
            todo_names = [todo_names[int(k * step)] for k in range(a.fallback)]
            print(f"fallback: a sample of {a.fallback} of the {len(fallback)} mutants")
        rx = "^(?:" + "|".join(rust_escape(n) for n in todo_names) + ")$"
        fb = os.path.join(out, "fallback")
        subprocess.run([os.path.join(ROOT, "scripts", "mutants.sh"), a.crate, "", fb], cwd=ROOT,
                       env=dict(os.environ, MUTANTS_RE=rx))
        fm = os.path.join(fb, "mutants.out", "missed.txt")
        if os.path.exists(fm):
            missed += sum(1 for l in open(fm) if l.strip())
    return 1 if a.fail_on_missed and missed else 0


def rust_escape(s):
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in s)


if __name__ == "__main__":
    sys.exit(main())
