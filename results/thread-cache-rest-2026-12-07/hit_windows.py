import sys, os
OPS=os.environ.get('OPS','ops')  # the folder of the .ops files
def windows(path,N=8,W=128,passes=3):
    parked=[]; live={}; out=[]; cnt=0; h=0
    lines=[l.split() for l in open(path) if l.strip() and not l.startswith('#')]
    for ps in range(passes):
        for p in lines:
            if p[0]=='a':
                i,size,st=p[1],int(p[2]),p[3]
                hit=False
                if 0<size<=1<<20:
                    for k in range(len(parked)-1,-1,-1):
                        if parked[k][1]==size and parked[k][2]==st:
                            parked.pop(k); hit=True; break
                    cnt+=1; h+=hit
                    if cnt==W: out.append(h); cnt=0; h=0
                live[i]=(size,st)
            elif p[0]=='f' and p[1] in live:
                size,st=live.pop(p[1])
                if size<=1<<20:
                    parked.append((p[1],size,st))
                    if len(parked)>N: parked.pop(0)
        # end of pass: live blocks stay? the benchmark frees all at pass end (release_all)
        for i,(size,st) in list(live.items()):
            live.pop(i)
            if size<=1<<20:
                parked.append((i,size,st))
                if len(parked)>N: parked.pop(0)
    return out
for t in sys.argv[1:]:
    print(t, windows(f'{OPS}/{t}.ops')[:12])
