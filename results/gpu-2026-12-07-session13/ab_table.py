#!/usr/bin/env python3
"""The front end before and after on one GPU: steady ns/op (passes 3-5, the mean of the three
passes' figures) of cachalot's default and of cachalot with PyTorch's policy, per trace, for
each build, the best of the rounds (the run least disturbed by the shared host).
Usage: ab_table.py AB_DIR   (AB_DIR/{base,new}_{1,2,3}/runs/*.json, from run13b.sh)"""
import glob, json, math, os, sys, collections

ab = sys.argv[1]
best = collections.defaultdict(lambda: math.inf)  # (build, allocator, trace) -> ns/op
for d in glob.glob(os.path.join(ab, "*_*")):
    build = os.path.basename(d).rsplit("_", 1)[0]
    for f in glob.glob(os.path.join(d, "runs", "*.json")):
        r = json.load(open(f))
        if r.get("kind") != "trace" or r.get("error"):
            continue
        steady = r["steady_passes_ns_per_op"][1:]  # passes 3-5
        v = sum(steady) / len(steady)
        k = (build, r["allocator"], r["trace"])
        best[k] = min(best[k], v)
traces = sorted({k[2] for k in best})
geo = collections.defaultdict(list)
print("| trace | c-pt, before | default, before (÷ c-pt) | c-pt, after | default, after (÷ c-pt) | default after ÷ before |")
print("|---|---:|---:|---:|---:|---:|")
for t in traces:
    cb, db = best[("base", "cachalot-pytorch", t)], best[("base", "cachalot", t)]
    ca, da = best[("new", "cachalot-pytorch", t)], best[("new", "cachalot", t)]
    if math.inf in (cb, db, ca, da):
        continue
    geo["before"].append(db / cb)
    geo["after"].append(da / ca)
    geo["change"].append(da / db)
    print(f"| {t} | {cb:,.0f} | {db:,.0f} ({db / cb:.2f}) | {ca:,.0f} | {da:,.0f} ({da / ca:.2f}) | {da / db:.3f} |")
g = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in geo.items()}
n12b = sum(x <= 1.2 for x in geo["before"])
n12a = sum(x <= 1.2 for x in geo["after"])
print(f"\n- geometric mean over {len(geo['after'])}: default ÷ c-pt before {g['before']:.3f} "
      f"(within 1.2× on {n12b}), after {g['after']:.3f} (within 1.2× on {n12a}); "
      f"default after ÷ before {g['change']:.3f}")
