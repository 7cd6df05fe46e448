#!/usr/bin/env python3
"""First-pass and steady figures per trace: PyTorch (call 1) against cachalot runs.
Usage: table.py PYTORCH_RUNS_DIR LABEL=RUNS_DIR ..."""
import json, glob, os, sys, math
py = sys.argv[1]
sets = [a.split('=', 1) for a in sys.argv[2:]]
def load(d, alloc):
    out = {}
    for f in glob.glob(os.path.join(d, f'{alloc}__*.json')):
        r = json.load(open(f))
        if r.get('kind') != 'trace' or r.get('error'):
            continue
        out[r['trace']] = r
    return out
pt = load(py, 'pytorch')
cpt = load(sets[0][1], 'cachalot-pytorch')
runs = [(label, load(d, 'cachalot')) for label, d in sets]
traces = sorted(pt)
hdr = '| trace | PyTorch first ns | c-pt first |' + ''.join(f' {l}: first (÷PT) | ratio | steady p3–5 (÷c-pt) | calls p3–5 |' for l, _ in runs)
print(hdr)
print('|---|---:|---:|' + '---:|---:|---:|---:|' * len(runs))
geo = {l: [] for l, _ in runs}
geo_s = {l: [] for l, _ in runs}
within2 = {l: 0 for l, _ in runs}
mem103 = {l: 0 for l, _ in runs}
within12 = {l: 0 for l, _ in runs}
no_calls = {l: 0 for l, _ in runs}
for t in traces:
    p = pt[t]['ns_per_op_first']
    c = cpt.get(t)
    row = f"| {t} | {p:,.0f} | {c['ns_per_op_first']:,.0f} |" if c else f"| {t} | {p:,.0f} | – |"
    for l, rs in runs:
        r = rs.get(t)
        if not r:
            row += ' – | – | – | – |'
            continue
        f = r['ns_per_op_first']
        geo[l].append(f / p)
        within2[l] += f <= 2 * p
        mem103[l] += r['ratio'] <= 1.03 + 1e-9
        st = r['steady_passes_ns_per_op'][1:]
        s = sum(st) / len(st)
        cs = c['steady_passes_ns_per_op'][1:] if c else None
        cs = sum(cs) / len(cs) if cs else None
        if cs:
            geo_s[l].append(s / cs)
            within12[l] += s <= 1.2 * cs
        calls = r['steady_passes_driver_calls'][1:]
        no_calls[l] += not any(calls)
        row += f" {f:,.0f} ({f/p:.2f}) | {r['ratio']:.3f} | {s:,.0f} ({s/cs:.2f}) | {' '.join(map(str, calls))} |" if cs else f" {f:,.0f} ({f/p:.2f}) | {r['ratio']:.3f} | {s:,.0f} | {' '.join(map(str, calls))} |"
    print(row)
print()
for l, _ in runs:
    g = math.exp(sum(map(math.log, geo[l])) / len(geo[l]))
    gs = math.exp(sum(map(math.log, geo_s[l])) / len(geo_s[l]))
    print(f"- {l}: first pass ÷ PyTorch's, geometric mean {g:.2f}× over {len(geo[l])}; within 2× on {within2[l]}; "
          f"memory ≤ 1.03 on {mem103[l]}; steady (passes 3–5) ÷ c-pt geometric mean {gs:.2f}×, "
          f"within 1.2× on {within12[l]}; no driver call in passes 3–5 on {no_calls[l]}")
