"""Session 14 figures: cachalot (default) against cachalot-pytorch (steady passes 3-5) and PyTorch (first pass),
memory ratio, steady driver calls. Usage: figures.py RUNS_DIR..."""
import glob, json, math, os, sys
def load(d, a):
    out = {}
    for f in glob.glob(os.path.join(d, f"{a}__*.json")):
        r = json.load(open(f))
        if r.get("kind") == "trace" and not r.get("error"):
            out[r["trace"]] = r
    return out
def geo(xs): return math.exp(sum(map(math.log, xs)) / len(xs))
for d in sys.argv[1:]:
    c, cpt, pt = load(d, "cachalot"), load(d, "cachalot-pytorch"), load(d, "pytorch")
    ts = sorted(c)
    st = lambda r: sum(r["steady_passes_ns_per_op"][1:]) / len(r["steady_passes_ns_per_op"][1:])
    sr = [st(c[t]) / st(cpt[t]) for t in ts if t in cpt]
    fr = [c[t]["ns_per_op_first"] / pt[t]["ns_per_op_first"] for t in ts if t in pt]
    mem = [c[t]["ratio"] for t in ts]
    calls = [t for t in ts if any(c[t]["steady_passes_driver_calls"][1:])]
    print(d, f"traces {len(ts)} (c-pt {len(cpt)}, pt {len(pt)})")
    print(f"  steady p3-5 / c-pt: geo {geo(sr):.3f}x, within 1.2x: {sum(x <= 1.2 for x in sr)} of {len(sr)}")
    print(f"  first / PyTorch:   geo {geo(fr):.3f}x, within 2x: {sum(x <= 2 for x in fr)} of {len(fr)}")
    print(f"  memory ratio:      geo {geo(mem):.4f}x, <=1.03: {sum(x <= 1.03 + 1e-9 for x in mem)} of {len(mem)}")
    print(f"  no steady call p3-5: {len(ts) - len(calls)} of {len(ts)}; with calls: " + ", ".join(f"{t} {c[t]['steady_passes_driver_calls'][1:]}" for t in calls))
