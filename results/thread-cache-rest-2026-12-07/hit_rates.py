import sys,glob,os
OPS=os.environ.get('OPS','ops')  # the folder of the .ops files (scripts/gpu_bench.sh exports them)
def sim(path,N=8):
    parked=[]; live={}; small=0; hits=0; 
    for line in open(path):
        p=line.split()
        if not p or p[0].startswith('#'): continue
        if p[0]=='a':
            i,size,st=p[1],int(p[2]),p[3]
            if size<=1<<20 and size>0:
                small+=1
                for k in range(len(parked)-1,-1,-1):
                    if parked[k][1]==size and parked[k][2]==st:
                        parked.pop(k); hits+=1; break
            live[i]=(size,st)
        elif p[0]=='f':
            i=p[1]
            if i in live:
                size,st=live.pop(i)
                if size<=1<<20:
                    parked.append((i,size,st))
                    if len(parked)>N: parked.pop(0)
    return small,hits
for f in sorted(glob.glob(OPS+'/*.ops')):
    s,h=sim(f)
    print(f"{os.path.basename(f)[:-4]:24s} small {s:6d} hits {h:6d} rate {h/max(s,1):.2f}")
