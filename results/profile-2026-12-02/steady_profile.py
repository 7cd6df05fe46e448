#!/usr/bin/env python3
"""The steady passes' instructions by part, from two callgrind runs of one trace:
`cachalot replay --pytorch --repeat 1` and `--repeat 5` (the difference is 4 steady passes).

    valgrind --tool=callgrind --callgrind-out-file=r1.out cachalot replay --pytorch --repeat 1 --json TRACE
    valgrind --tool=callgrind --callgrind-out-file=r5.out cachalot replay --pytorch --repeat 5 --json TRACE
    steady_profile.py r1.out r5.out OPS [TOP]

Needs a build with line tables (CARGO_PROFILE_RELEASE_DEBUG=line-tables-only): each cost is
filed under the source file its instructions came from, inlined or not."""
import collections, re, subprocess, sys

def load(path):
    out = subprocess.run(['callgrind_annotate', '--threshold=100', '--auto=no', path],
                         capture_output=True, text=True, check=True).stdout
    costs, total = collections.Counter(), None
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+)\s+\([\s\d.]+%\)\s+(.*)$', line)
        if not m:
            continue
        n, name = int(m.group(1).replace(',', '')), re.sub(r'\s*\[[^\]]*\]$', '', m.group(2))
        if 'PROGRAM TOTALS' in name:
            total = n
        else:
            costs[name] += n
    return total, costs

PARTS = [
    ('free set and other BTreeMaps (std btree)', r'collections/btree'),
    ('live-block hash map (hashbrown)', r'hashbrown'),
    ('heap (libc malloc/free) and memcpy', r'malloc\.c|memmove|memcpy'),
    ('statistics (allocator/src/stats.rs)', r'allocator/src/stats\.rs'),
    ('history recorder (allocator/src/history.rs)', r'allocator/src/history\.rs'),
    ('simulated device (backend/sim.rs)', r'backend/sim\.rs'),
    ('policy core (policy/, block.rs, sizes.rs)', r'allocator/src/(policy|block\.rs|sizes\.rs)'),
    ('replay loop (src/replay/)', r'^src/replay/|cachalot_tools::replay'),
]

def part(name):
    file = name.split(':', 1)[0]
    for label, pattern in PARTS:
        if re.search(pattern, file):
            return label
    # std code inlined into a function (core::cmp into a BTreeMap search, say): filed under
    # the function's part
    func = name.split(':', 1)[1] if ':' in name else name
    if 'collections::btree' in func:
        return PARTS[0][0]
    if 'hashbrown' in func or 'hash::' in func:
        return PARTS[1][0]
    if 'cachalot::stats' in func:
        return PARTS[3][0]
    if 'cachalot::policy' in func or 'cachalot::block' in func:
        return 'policy core (policy/, block.rs, sizes.rs)'
    if 'cachalot_tools::replay' in func:
        return 'replay loop (src/replay/)'
    return 'other'

r1, r5, ops = sys.argv[1], sys.argv[2], int(sys.argv[3])
top = int(sys.argv[4]) if len(sys.argv) > 4 else 25
t1, a = load(r1)
t5, b = load(r5)
steady = t5 - t1
per = 4 * ops
print(f'steady passes: {steady:,} instructions over 4 x {ops:,} operations = {steady / per:.1f} per operation\n')
groups = collections.Counter()
diff = {k: b[k] - a.get(k, 0) for k in b}
for k, v in diff.items():
    groups[part(k)] += v
print(f'{"part":<48} {"Ir/op":>8} {"share":>7}')
for k, v in groups.most_common():
    if v > 0:
        print(f'{k:<48} {v / per:8.1f} {100 * v / steady:6.1f}%')
print(f'\ntop {top} by source file:function (exclusive)')
for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
    print(f'{v / per:8.1f} Ir/op {100 * v / steady:5.1f}%  {k[:150]}')
