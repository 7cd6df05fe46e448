# Per-function steady cost of two allocators from callgrind files (results/steady-gap-2026-12-06):
# python3 callgrind_diff.py PREFIX A B LINES reads PREFIX_A.{2,7}.cg and PREFIX_B.{2,7}.cg (timed
# passes of a 2- and a 7-pass gpu_compare run) and prints, per function, B − A, A, B in self
# instructions per steady line ((I7 − I2) / 5 / LINES), largest difference first.
import subprocess, re, sys, collections
def load(f):
    out = subprocess.run(['callgrind_annotate','--inclusive=no','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d = collections.Counter()
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([ \d.]+%\)\s+(.*)$', line)
        if m and 'PROGRAM TOTALS' not in line:
            name = m.group(2)
            name = re.sub(r' \[.*\]$','',name)
            fn = name.split(':',1)[1] if ':' in name else name
            fn = re.sub(r'<[^<>]*>','',fn); fn = re.sub(r'<[^<>]*>','',fn)
            fn = re.sub(r" \([\d,]+x\)","",fn)
            d[fn] += int(m.group(1).replace(',',''))
    return d
pre, a, b, lines = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
A = load(f'{pre}_{a}.7.cg'); A2 = load(f'{pre}_{a}.2.cg')
B = load(f'{pre}_{b}.7.cg'); B2 = load(f'{pre}_{b}.2.cg')
keys = set(A)|set(B)|set(A2)|set(B2)
rows = []
for k in keys:
    sa = (A[k]-A2[k])/5/lines; sb = (B[k]-B2[k])/5/lines
    rows.append((sb-sa, sa, sb, k))
rows.sort(reverse=True)
print(f"total {a} {sum(r[1] for r in rows):.0f}  {b} {sum(r[2] for r in rows):.0f}")
for r in rows[:35]: print(f"{r[0]:7.1f} {r[1]:7.1f} {r[2]:7.1f}  {r[3][:150]}")
print('...')
for r in rows[-10:]: print(f"{r[0]:7.1f} {r[1]:7.1f} {r[2]:7.1f}  {r[3][:150]}")
