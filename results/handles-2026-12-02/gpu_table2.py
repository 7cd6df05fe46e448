#!/usr/bin/env python3
"""Rule 19j on the H200: cachalot's policy's first pass and memory under each setting, from a run
without PyTorch (RUN dirs), against PyTorch's first pass from another run (PT dir) on another
host: each figure is divided by c-pt's in its own run and multiplied by c-pt ÷ PyTorch of the
PyTorch run (host-adjusted). Usage: table2.py PT_DIR LABEL=RUN_DIR ..."""
import json, glob, os, sys, math
def load(d, a):
    o = {}
    for f in glob.glob(os.path.join(d, 'runs', f'{a}__*.json')):
        r = json.load(open(f))
        if r.get('kind') == 'trace' and not r.get('error'):
            o[r['trace']] = r
    return o
ptdir = sys.argv[1]
pt, cpt1 = load(ptdir, 'pytorch'), load(ptdir, 'cachalot-pytorch')
runs = [(l, load(d, 'cachalot'), load(d, 'cachalot-pytorch')) for l, d in (a.split('=', 1) for a in sys.argv[2:])]
def gm(v): return math.exp(sum(map(math.log, v)) / len(v))
print('| trace | ' + ' | '.join(f'{l}: first ns (÷ PyTorch, adjusted) | memory ÷ in use | calls per steady pass (p2–5) | steady p3–5 ÷ c-pt' for l, _, _ in runs) + ' |')
print('|---|' + '---:|---:|---|---:|' * len(runs))
stats = {l: {'first': [], 'steady': [], 'w2': 0, 'm': 0, 'calls': 0, 'calls35': 0} for l, _, _ in runs}
for t in sorted(pt):
    row = f'| {t} |'
    for l, rs, cs in runs:
        r, c = rs.get(t), cs.get(t)
        if not r or not c:
            row += ' – | – | – | – |'; continue
        adj = r['ns_per_op_first'] / c['ns_per_op_first'] * cpt1[t]['ns_per_op_first'] / pt[t]['ns_per_op_first']
        st = sum(r['steady_passes_ns_per_op'][1:]) / 3
        cst = sum(c['steady_passes_ns_per_op'][1:]) / 3
        S = stats[l]
        S['first'].append(adj); S['steady'].append(st / cst)
        S['w2'] += adj <= 2; S['m'] += r['ratio'] <= 1.03 + 1e-9
        S['calls'] += sum(r['steady_passes_driver_calls']); S['calls35'] += sum(r['steady_passes_driver_calls'][1:])
        row += f" {r['ns_per_op_first']:,.0f} ({adj:.2f}) | {r['ratio']:.3f} | {' '.join(map(str, r['steady_passes_driver_calls']))} | {st/cst:.2f} |"
    print(row)
print()
for l, S in stats.items():
    n = len(S['first'])
    print(f"- {l}: first pass ÷ PyTorch's (host-adjusted) geometric mean {gm(S['first']):.2f}× over {n}, within 2× on {S['w2']}; "
          f"memory ≤ 1.03× in use on {S['m']}; steady passes 3–5 ÷ c-pt geometric mean {gm(S['steady']):.2f}×; "
          f"calls in passes 2–5 {S['calls']}, 3–5 {S['calls35']}")
