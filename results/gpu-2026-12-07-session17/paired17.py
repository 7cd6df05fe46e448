# Paired ratios: in each repetition of the base and vec runs, c-pt and the default replay the
# same trace back to back (gpu_compare runs the allocators of one trace in turn), so their
# ratio cancels the host's drift between repetitions. Per trace: the median of the 6 paired
# ratios, and their spread (min-max). Also each allocator's own spread over repetitions.
import json, glob, statistics as st, collections, math, sys
D = sys.argv[1] if len(sys.argv) > 1 else '.'
def steady(d):
    v = d['steady_passes_ns_per_op'][1:4]
    return sum(v) / len(v)
runs = collections.defaultdict(dict)   # (variant, rep) -> {(alloc, trace): ns}
for f in glob.glob(f'{D}/*_*/runs/*.json'):
    variant, rep = f.split('/')[-3].rsplit('_', 1)
    d = json.load(open(f))
    if d.get('kind') != 'trace':
        continue
    runs[(variant, int(rep))][(d['allocator'], d['trace'])] = steady(d)
traces = sorted({t for r in runs.values() for (_, t) in r})
reps = sorted({k[1] for k in runs})
print('| trace | default ÷ c-pt, base build: median (min-max) of 6 | the same, sorted-index build | c-pt ns, median (min-max) |')
print('|---|---|---|---|')
gm = collections.defaultdict(list); within = collections.Counter(); own = []
for t in traces:
    cells = []
    for variant in ('base', 'vec'):
        rs = [runs[(variant, r)][('cachalot', t)] / runs[(variant, r)][('cachalot-pytorch', t)] for r in reps]
        m = st.median(rs)
        gm[variant].append(m); within[variant] += m <= 1.2
        cells.append(f'{m:.2f} ({min(rs):.2f}-{max(rs):.2f})')
    c = [runs[('base', r)][('cachalot-pytorch', t)] for r in reps] + [runs[('vec', r)][('cachalot-pytorch', t)] for r in reps]
    own.append((max(c) - min(c)) / st.median(c))
    print(f'| {t} | {cells[0]} | {cells[1]} | {st.median(c):.0f} ({min(c):.0f}-{max(c):.0f}) |')
for v in ('base', 'vec'):
    g = math.exp(sum(map(math.log, gm[v])) / len(gm[v]))
    print(f'\n- {v}: median paired ratio, geometric mean over {len(gm[v])} traces {g:.3f}; within 1.2x on {within[v]}', end='')
print(f'\n- c-pt alone over the 12 runs of both builds, (max-min)/median, median over traces: {st.median(own):.2f}')
