# Steady events per pass and per line of two allocators from cache_passes.sh's files:
# python3 cache_table.py OUTDIR LINES  (LINES: the ops files' lines together)
import sys
ev = "Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim".split()
out, lines = sys.argv[1], int(sys.argv[2])
d = {}
for a in ['cachalot-pytorch', 'cachalot']:
    v = {}
    for p in [2, 7]:
        for l in open(f'{out}/{a}_{p}.cg'):
            if l.startswith('summary:'):
                v[p] = list(map(int, l.split()[1:]))
    d[a] = [(x7 - x2) / 5 for x2, x7 in zip(v[2], v[7])]
print(f"{'event':6s} {'c-pt/line':>10s} {'default/line':>13s} {'ratio':>6s}")
for i, e in enumerate(ev):
    a, b = d['cachalot-pytorch'][i] / lines, d['cachalot'][i] / lines
    print(f"{e:6s} {a:10.2f} {b:13.2f} {b / a if a else float('inf'):6.2f}")
