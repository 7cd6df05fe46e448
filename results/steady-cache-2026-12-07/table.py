import sys
def rd(n):
    d={}
    for l in open(f'{n}.tsv'):
        t,n_,a,b=l.split(); d[t]=(int(b)-int(a))/5/int(n_)
    return d
names=sys.argv[1:]
D=[rd(n) for n in names]
print(f"{'trace':24s}"+"".join(f"{n:>10s}" for n in names)+"".join(f"{'÷'+n:>10s}" for n in names[1:]))
import math
g=[0]*len(names)
for t in sorted(D[0]):
    if not all(t in d for d in D): continue
    print(f"{t:24s}"+"".join(f"{d[t]:10.0f}" for d in D)+"".join(f"{d[t]/D[0][t]:10.2f}" for d in D[1:]))
