#!/usr/bin/env python3
import sys,math
# The ratio table: ratio_table.py BASE.tsv OTHER.tsv... (instructions per steady line, and each ÷ BASE).
def load(f):
    r={}
    for l in open(f):
        t,n,a,b=l.split(); n,a,b=int(n),int(a),int(b)
        r[t]=((b-a)/5/n, a/2/n)
    return r
base=load(sys.argv[1]); others=[(f,load(f)) for f in sys.argv[2:]]
print(f"{'trace':28s} {'base':>6s} "+" ".join(f"{f.split('/')[-1][:10]:>10s}" for f,_ in others))
gs=[[] for _ in others]
for t in sorted(base):
    row=f"{t:28s} {base[t][0]:6.0f} "
    for i,(f,o) in enumerate(others):
        r=o[t][0]/base[t][0]; gs[i].append(r); row+=f"{o[t][0]:6.0f}{r:5.2f}x"[-11:].rjust(11)
    print(row)
print("geomean", " ".join(f"{math.exp(sum(map(math.log,g))/len(g)):.3f} ({sum(x<=1.2 for x in g)}/{len(g)})" for g in gs))
