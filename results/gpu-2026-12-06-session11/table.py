#!/usr/bin/env python3
"""table.md from this run's files: `tar xzf runs.tgz && python3 table.py > table.md`.
cachalot with PyTorch's policy (c-pt) and the default policy, steady = mean of passes 3-4;
PyTorch's own allocator where its half of the run reached the program."""
import glob, json, math, statistics as st

runs = {}
for f in glob.glob('runs/*.json') + glob.glob('pt/runs/*.json'):
    j = json.load(open(f))
    if j.get('kind') == 'trace':
        runs[(j['allocator'], j['trace'])] = j
ts = sorted({t for a, t in runs if a == 'cachalot'})
print("| trace | lines | c-pt steady p3–4 ns/op | default steady p3–4 | ÷ c-pt | default calls p2–4 "
      "| default ratio (peak reserved ÷ peak requested) | c-pt ratio | PyTorch first / steady ns/op "
      "| default first ns/op (÷ PyTorch's first) |")
print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
rs, within, fr = [], 0, []
for t in ts:
    a, b = runs[('cachalot-pytorch', t)], runs[('cachalot', t)]
    sa = st.mean(a['steady_passes_ns_per_op'][1:])
    sb = st.mean(b['steady_passes_ns_per_op'][1:])
    r = sb / sa
    rs.append(r)
    within += r <= 1.2
    p = runs.get(('pytorch', t))
    ptxt = f"{p['ns_per_op_first']:,.0f} / {st.mean(p['steady_passes_ns_per_op'][1:]):,.0f}" if p else "–"
    ftxt = f"{b['ns_per_op_first']:,.0f}"
    if p:
        ftxt += f" ({b['ns_per_op_first'] / p['ns_per_op_first']:.2f})"
        fr.append(b['ns_per_op_first'] / p['ns_per_op_first'])
    print(f"| {t} | {b['lines']:,} | {sa:,.0f} | {sb:,.0f} | {r:.2f} | {b['steady_passes_driver_calls']} "
          f"| {b['ratio']:.3f} | {a['ratio']:.3f} | {ptxt} | {ftxt} |")
g = math.exp(sum(map(math.log, rs)) / len(rs))
print(f"\nDefault steady (passes 3–4) ÷ c-pt: geometric mean **{g:.2f}×** over {len(rs)}; "
      f"within 1.2× on {within} of {len(rs)}.")
print(f"First pass ÷ PyTorch's first, the {len(fr)} programs PyTorch's half reached: geometric mean "
      f"{math.exp(sum(map(math.log, fr)) / len(fr)):.2f}×.")
