# Steady ns/op (passes 3-5) per trace: c-pt, default, default with N = 0, default with the
# sorted-vector index; median over the repetitions of each run; ratio to c-pt's median.
import json, glob, os, statistics as st, sys, collections
D = sys.argv[1] if len(sys.argv) > 1 else '.'
def steady(d):
    v = d['steady_passes_ns_per_op'][1:4]   # passes 3-5 (the list starts at pass 2)
    return sum(v) / len(v)
vals = collections.defaultdict(list)   # (variant, allocator, trace) -> [ns]
calls = {}
mem = {}
for f in glob.glob(f'{D}/*_*/runs/*.json'):
    variant = f.split('/')[-3].rsplit('_', 1)[0]
    d = json.load(open(f))
    if d.get('kind') != 'trace':
        continue
    k = (variant, d['allocator'], d['trace'])
    vals[k].append(steady(d))
    calls[k] = d['steady_passes_driver_calls'][1:4]
    mem[k] = d['ratio']
traces = sorted({k[2] for k in vals})
med = {k: st.median(v) for k, v in vals.items()}
rows = []
print('| trace | c-pt ns | default ns (÷c-pt) | N = 0 (÷c-pt) | sorted index (÷c-pt) | c-pt, sorted-index build | default calls p3-5 | N = 0 calls p3-5 | memory default / N = 0 |')
print('|---|---:|---:|---:|---:|---:|---|---|---|')
gm = collections.defaultdict(list)
within = collections.Counter()
for t in traces:
    c = med.get(('base', 'cachalot-pytorch', t)); b = med.get(('base', 'cachalot', t))
    n = med.get(('n0', 'cachalot', t)); v = med.get(('vec', 'cachalot', t)); cv = med.get(('vec', 'cachalot-pytorch', t))
    if None in (c, b, n, v, cv):
        continue
    for name, x, ref in (('default', b, c), ('n0', n, c), ('vec', v, cv)):
        gm[name].append(x / ref)
        within[name] += x / ref <= 1.2
    print(f"| {t} | {c:.0f} | {b:.0f} ({b/c:.2f}) | {n:.0f} ({n/c:.2f}) | {v:.0f} ({v/cv:.2f}) | {cv:.0f} | {calls[('base','cachalot',t)]} | {calls[('n0','cachalot',t)]} | {mem[('base','cachalot',t)]:.3f} / {mem[('n0','cachalot',t)]:.3f} |")
import math
for name in ('default', 'n0', 'vec'):
    g = math.exp(sum(math.log(x) for x in gm[name]) / len(gm[name]))
    print(f"\n- {name}: steady ÷ c-pt geometric mean {g:.3f} over {len(gm[name])}, within 1.2x on {within[name]}", end='')
print()
# noise: spread of the repetitions of c-pt
spread = [ (max(v)-min(v))/st.median(v) for k, v in vals.items() if k[1]=='cachalot-pytorch' and k[0]=='base']
print(f"- c-pt's spread over {len(next(iter(vals.values())))} repetitions ((max-min)/median), median over traces: {st.median(spread):.3f}")
