"""Per-function steady cost of one allocator from two cachegrind files (results/branch-misses-2026-12-07).

    python3 cachegrind_diff.py A.7.out A.2.out EVENT LINES [N]

A.7.out and A.2.out: `valgrind --tool=cachegrind --branch-sim=yes [--cache-sim=yes]` of a 7- and
a 2-pass `gpu_compare --backend sim --no-hot --only A` run. Prints EVENT (Ir, Bcm, D1mr, ...)
per steady line, (count at 7 − count at 2) / LINES with LINES = 5 × the program's lines, in
total and for the N functions (default 25) with the most.
"""
import collections
import sys


def load(path):
    events, fn = None, None
    per_fn = collections.defaultdict(collections.Counter)
    for line in open(path):
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("fn="):
            fn = line[3:].strip()
        elif line[:1].isdigit():
            for e, v in zip(events, line.split()[1:]):
                per_fn[fn][e] += int(v)
    return per_fn


a7, a2 = load(sys.argv[1]), load(sys.argv[2])
event, lines = sys.argv[3], float(sys.argv[4])
top = int(sys.argv[5]) if len(sys.argv) > 5 else 25
diff = {f: a7[f][event] - a2[f][event] for f in a7}
print(f"total {event} per steady line: {sum(diff.values()) / lines:.2f}")
for f, v in sorted(diff.items(), key=lambda x: -x[1])[:top]:
    print(f"{v / lines:8.3f}  {f[:150]}")
