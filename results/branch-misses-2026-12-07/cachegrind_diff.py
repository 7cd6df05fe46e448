import sys,collections,re
def load(p):
    ev=None; fn=None; fl=None; tot=collections.defaultdict(lambda: collections.Counter())
    for line in open(p):
        if line.startswith('events:'): ev=line.split()[1:]; continue
        if line.startswith('fl='): fl=line[3:].strip(); continue
        if line.startswith('fn='): fn=line[3:].strip(); continue
        if line[:1].isdigit():
            parts=line.split()
            vals=parts[1:]
            for e,v in zip(ev,vals): tot[fn][e]+=int(v)
    return tot
a7=load(sys.argv[1]); a2=load(sys.argv[2]); ev=sys.argv[3]; lines=float(sys.argv[4])
d={f:a7[f][ev]-a2.get(f,collections.Counter())[ev] for f in a7}
T=sum(d.values())
print(f"total {ev} per steady line: {T/lines:.2f}")
for f,v in sorted(d.items(),key=lambda x:-x[1])[:int(sys.argv[5]) if len(sys.argv)>5 else 25]:
    print(f"{v/lines:8.3f}  {f[:150]}")
