#!/usr/bin/env python3
"""Steady-state speed of one allocator against another, from repeated gpu_compare runs.

One 5-pass run cannot judge a ratio of 1.2x trace by trace: on one H200 the same binary's
steady ns/op varies by (max - min) / median = 0.88 from run to run (the median over the
benchmark's traces, results/gpu-2026-12-07-session17/). Within one run, gpu_compare replays
the allocators of a trace back to back, so their ratio cancels much of that drift. This script
takes several runs (each a `gpu_compare --out DIR` folder: DIR/runs/ALLOCATOR__TRACE.json),
takes in each the ratio B / A of the two allocators' steady figures (the mean ns/op of passes
FROM.. of `steady_passes_ns_per_op`), and prints per trace the median ratio over the runs with
its range, then the geometric mean of the medians, how many are within the threshold, and how
much A alone varies from run to run (the median over traces of (max - min) / median).

usage: scripts/steady_ratio.py [--from 3] [--within 1.2] A B RUN_DIR [RUN_DIR ...]
  e.g. scripts/steady_ratio.py cachalot-pytorch cachalot out1 out2 out3 out4 out5 out6
"""
import argparse
import glob
import json
import math
import os
import statistics
import sys


def steady(run, first_pass):
    """Mean ns/op of passes first_pass.. (the list starts at pass 2)."""
    passes = run.get("steady_passes_ns_per_op") or []
    chosen = passes[first_pass - 2:]
    return sum(chosen) / len(chosen) if chosen else None


def load(run_dir, allocator, first_pass):
    """trace -> steady ns/op of `allocator` in one run folder."""
    out = {}
    for path in glob.glob(os.path.join(run_dir, "runs", f"{allocator}__*.json")):
        with open(path) as f:
            run = json.load(f)
        if run.get("kind") != "trace" or run.get("allocator") != allocator:
            continue
        value = steady(run, first_pass)
        if value:
            out[run["trace"]] = value
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="first", type=int, default=3,
                   help="first steady pass averaged (default 3: passes 3..)")
    p.add_argument("--within", type=float, default=1.2, help="threshold counted (default 1.2)")
    p.add_argument("a", help="the reference allocator (e.g. cachalot-pytorch)")
    p.add_argument("b", help="the allocator measured against it (e.g. cachalot)")
    p.add_argument("runs", nargs="+", help="gpu_compare --out folders, one per repetition")
    args = p.parse_args()
    if args.first < 2:
        sys.exit("--from: the steady passes start at pass 2")
    ratios = {}
    alone = {}
    for run_dir in args.runs:
        a = load(run_dir, args.a, args.first)
        b = load(run_dir, args.b, args.first)
        for trace in a.keys() & b.keys():
            ratios.setdefault(trace, []).append(b[trace] / a[trace])
        for trace, ns in a.items():
            alone.setdefault(trace, []).append(ns)
    if not ratios:
        sys.exit(f"no trace with both {args.a} and {args.b} in {args.runs}")
    print(f"| trace | {args.b} / {args.a}, passes {args.first}.., median of runs (min-max) | runs |")
    print("|---|---|---:|")
    medians = []
    for trace in sorted(ratios):
        r = ratios[trace]
        m = statistics.median(r)
        medians.append(m)
        print(f"| {trace} | {m:.2f} ({min(r):.2f}-{max(r):.2f}) | {len(r)} |")
    gmean = math.exp(sum(math.log(m) for m in medians) / len(medians))
    within = sum(m <= args.within for m in medians)
    print(f"\n- geometric mean of the medians over {len(medians)} traces: {gmean:.3f}; "
          f"within {args.within}x: {within}")
    spreads = [(max(v) - min(v)) / statistics.median(v) for v in alone.values() if len(v) > 1]
    if spreads:
        print(f"- {args.a} alone from run to run, (max - min) / median, median over "
              f"{len(spreads)} traces: {statistics.median(spreads):.2f}")


if __name__ == "__main__":
    main()
