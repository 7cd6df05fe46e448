#!/usr/bin/env python3
"""Make a large synthetic PyTorch memory snapshot for timing `cachalot replay`.

It concatenates COPIES runs of a recorded trace (by default the largest fixture,
gpt2_generate: 29.7k operations, 1.5 MB) into one device trace, shifting each run's
addresses by 2^44 bytes so that the runs never share a block: the result is what one
process running the workload COPIES times in a row, never freeing what each run kept,
would record. Each run's final segments are kept too, so the file stays a valid snapshot
that PyTorch's tools read. Plain Python, no PyTorch needed.

usage: scripts/make_large_trace.py OUT.pickle [COPIES] [SOURCE.pickle]
"""
import pickle
import sys

out = sys.argv[1]
copies = int(sys.argv[2]) if len(sys.argv) > 2 else 4
source = sys.argv[3] if len(sys.argv) > 3 else "tests/fixtures/traces/gpt2_generate.pickle"
with open(source, "rb") as f:
    snap = pickle.load(f)
SHIFT = 1 << 44
trace = snap["device_traces"][0]
entries, segments = [], []
for c in range(copies):
    for e in trace:
        e = dict(e)
        if e["action"] != "oom":
            e["addr"] = e["addr"] + c * SHIFT
        entries.append(e)
    for s in snap["segments"]:
        s = dict(s, address=s["address"] + c * SHIFT)
        s["blocks"] = [dict(b, address=b["address"] + c * SHIFT) for b in s["blocks"]]
        segments.append(s)
snap["device_traces"] = [entries] + snap["device_traces"][1:]
snap["segments"] = segments
with open(out, "wb") as f:
    pickle.dump(snap, f, protocol=4)
print(f"{out}: {len(entries)} trace entries from {copies} copies of {source}")
