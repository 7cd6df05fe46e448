#!/usr/bin/env python3
"""BENCHMARKS.md's headline table from one side-by-side run: memory from results.md's
geometric-mean row (peak reserved / peak in use), steady ns/op (geometric mean of passes 2-5,
passes 3-5 in brackets), driver calls per steady pass summed over the programs, hot pairs.
Usage: headline.py RESULTS_JSON RUNS_DIR RESULTS_MD"""
import glob, json, math, os, sys

res = json.load(open(sys.argv[1]))
runs = sys.argv[2]
NAMES = [
    ("pytorch", "PyTorch 2.11, defaults"),
    ("pytorch-expandable", "PyTorch 2.11, expandable segments"),
    ("cuda-pool", "CUDA stream-ordered pool"),
    ("cachalot-pytorch", "cachalot, PyTorch's policy"),
    ("cachalot-expandable", "cachalot, PyTorch + expandable segments"),
    ("cachalot", "**cachalot's policy** (the default)"),
]


def geo(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def trace_runs(alloc):
    out = {}
    for f in glob.glob(os.path.join(runs, f"{alloc}__*.json")):
        r = json.load(open(f))
        if r.get("kind") == "trace" and not r.get("error"):
            out[r["trace"]] = r
    return out


# results.md's memory table: the geometric-mean row, columns in NAMES' order after cuMemAlloc.
row = next(l for l in open(sys.argv[3]) if l.startswith("| geometric mean"))
cells = [c.strip() for c in row.strip().strip("|").split("|")][3:]
order = ["pytorch", "pytorch-expandable", "cuda-pool", "cumemalloc", "cachalot-pytorch", "cachalot-expandable", "cachalot"]
memory = {a: float(c) for a, c in zip(order, cells) if c not in ("", "–")}

hot = {}
for h in res["hot_loops"]:
    if h.get("error"):
        continue
    hot.setdefault(h["allocator"], {})[h["path"]] = (h["wall_ns_per_pair"][0], h["wall_ns_per_pair"][-1])

print("| allocator | memory ÷ in use | steady ns/op | driver calls per steady pass | 1 MiB hot pair, 1 thread | 8 threads, wall per pair |")
print("|---|---:|---:|---:|---:|---:|")
for alloc, label in NAMES:
    rs = trace_runs(alloc)
    ratio = memory.get(alloc)
    s25 = geo([r["ns_per_op_steady"] for r in rs.values()])
    s35 = geo([sum(r["steady_passes_ns_per_op"][1:]) / len(r["steady_passes_ns_per_op"][1:]) for r in rs.values()])
    calls = [r.get("steady_passes_driver_calls") for r in rs.values()]
    if all(calls):
        c25 = sum(sum(c) / len(c) for c in calls)
        c35 = sum(sum(c[1:]) / len(c[1:]) for c in calls)
        cs = f"{c25:.1f} ({c35:.1f})"
    else:
        cs = "–"
    h = hot.get(alloc, {})
    one = " / ".join(f"{v[0]:,.1f} ns ({k})" for k, v in sorted(h.items()))
    eight = " / ".join(f"{v[1]:,.1f} ns ({k})" for k, v in sorted(h.items()))
    print(f"| {label} | {ratio:.3f} | {s25:,.0f} ({s35:,.0f}) | {cs} | {one} | {eight} |" if ratio else f"| {label} | – | {s25:,.0f} ({s35:,.0f}) | {cs} | {one} | {eight} |")
