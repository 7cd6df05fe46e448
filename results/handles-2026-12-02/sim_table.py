import json, glob, os, re, sys
sets = ['default', 'h2', 'h32']
data = {}
for s in sets:
    for f in glob.glob(f'/tmp/sim8/{s}/runs/cachalot__*.json'):
        r = json.load(open(f))
        m = re.search(r'\((\d+) handles\)', r.get('driver_calls_detail') or '')
        data.setdefault(r['trace'], {})[s] = (r['ratio'], int(m.group(1)) if m else None,
                                            r['driver_calls'], r['steady_passes_driver_calls'])
print('| trace | ' + ' | '.join(f'{s}: handles, observed pass | calls, pass 1 | calls, passes 2–5 | ratio' for s in sets) + ' |')
print('|---|' + '---:|---:|---|---:|' * len(sets))
tot = {s: [0, 0, 0] for s in sets}
over = {s: 0 for s in sets}
for t in sorted(data):
    row = f'| {t} |'
    for s in sets:
        ratio, h, calls, steady = data[t][s]
        row += f' {h} | {calls} | {" ".join(map(str, steady))} | {ratio:.3f} |'
        tot[s][0] += h; tot[s][1] += sum(steady); tot[s][2] += sum(steady[1:])
        over[s] += ratio > 1.03 + 1e-9
    print(row)
print()
for s in sets:
    print(f'- {s}: handles in the observed pass {tot[s][0]:,}; steady calls passes 2–5 {tot[s][1]:,}, 3–5 {tot[s][2]:,}; above 1.03× on {over[s]} of {len(data)}')
