# Steady driver calls per pass of the `cachalot` allocator in one or more `gpu_compare --backend
# sim --only cachalot` result folders, side by side (results/steady-calls-2026-12-06):
#   python3 steady_calls.py DIR [DIR...]
# Per trace: peak reserved ÷ peak requested (the observed pass), then the driver calls of each
# pass after the first. Last line: the calls of passes 3 and later, all traces, and without the
# two programs that call empty_cache() every pass (cuda_graph_mlp, empty_cache_loop).
import glob, json, sys
dirs = sys.argv[1:]
rows = {}
for i, d in enumerate(dirs):
    for f in sorted(glob.glob(d + '/runs/cachalot__*.json')):
        j = json.load(open(f))
        rows.setdefault(j['trace'], [None] * len(dirs))[i] = (j['ratio'], j['steady_passes_driver_calls'])
every = [0] * len(dirs)
kept = [0] * len(dirs)
for t, v in sorted(rows.items()):
    cells = [f"{x[0]:.3f} {x[1]}" if x else "-" for x in v]
    print(f"{t:28s}" + " | ".join(cells))
    for i, x in enumerate(v):
        if x:
            n = sum(x[1][1:])
            every[i] += n
            if t not in ('cuda_graph_mlp', 'empty_cache_loop'):
                kept[i] += n
print("calls in passes 3 and later, every trace:", every, " without the two that empty the cache:", kept)
